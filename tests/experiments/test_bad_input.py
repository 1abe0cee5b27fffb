"""Bad input is one line naming the fix, exit code 2, and nothing written to the run directory.

Each case is a command line (and the files it names, made in ``tmp_path``); the command runs
in process through :func:`experiments.cli.main`. A refused run leaves no ``run.sqlite`` or
``config.yaml`` behind, so the corrected command runs as it is (no "already holds a run").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from experiments.cli import main
from experiments.config import RunConfig, _base_type, _hints, from_mapping, leaves
from experiments.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = "eval_out_of_distribution"

# a file of prompts: every react_<type>_0/_1 pair of the six ALFWorld task types
TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")
GOOD_PROMPTS = {f"react_{t}_{k}": f"You are in a room.\n> look\nNothing.{k}" for t in TYPES for k in (0, 1)}  # fmt: skip


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# -- the cases: (id, a function of tmp_path -> the run flags, what stderr names) ------------------
Case = tuple[str, Callable[[Path], list[str]], str]


def _prompts(
    content: str | bytes | None, name: str = "prompts.json"
) -> Callable[[Path], list[str]]:
    """``--prompts`` naming a file with ``content`` (None: no file; b"/": a folder)."""

    def flags(tmp: Path) -> list[str]:
        path = tmp / name
        if content == b"/":
            path.mkdir()
        elif content is not None:
            _write(path, content)
        return ["--prompts", str(path)]

    return flags


def _yaml(text: str | bytes) -> Callable[[Path], list[str]]:
    def flags(tmp: Path) -> list[str]:
        return ["--config", str(_write(tmp / "config.yaml", text))]

    return flags


def _flags(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: list(args)


def _fifo(flag: str) -> Callable[[Path], list[str]]:
    """``flag`` naming a FIFO: reading it would wait for a writer that never comes."""

    def flags(tmp: Path) -> list[str]:
        path = tmp / "fifo"
        os.mkfifo(path)
        return [flag, str(path)]

    return flags


RUN_CASES: list[Case] = [
    # 5: tracebacks that become one line
    ("no-api-key", _flags("--model", "openai:gpt-4o"), "OPENAI_API_KEY"),
    ("no-api-key-reflector", _flags("--reflect-model", "anthropic:claude-x"), "ANTHROPIC_API_KEY"),
    ("no-api-key-escalate", _flags("--escalate-model", "openai:gpt-4o"), "OPENAI_API_KEY"),
    ("binary-config", _yaml(b"\xff\xfe\x00\x81binary\x00"), "not text"),
    ("top-p-5", _flags("--top-p", "5"), "top-p must be <= 1"),
    ("top-p-0", _flags("--top-p", "0"), "top-p must be > 0"),
    ("top-p-nan", _flags("--top-p", "nan"), "finite"),
    ("prompts-missing", _prompts(None), "does not exist"),
    ("prompts-folder", _prompts(b"/"), "is a folder"),
    ("prompts-malformed", _prompts('{"react_put_0": '), "not valid JSON"),
    ("prompts-list", _prompts('["react_put_0"]'), "JSON array"),
    ("prompts-empty", _prompts("{}"), "no react_<type>_0/_1 pairs"),
    ("prompts-wrong-types", _prompts(json.dumps({**GOOD_PROMPTS, "react_put_0": 7})), "string"),
    ("prompts-binary", _prompts(b"\x89PNG\r\n\x1a\n\x00\xff"), "not text"),
    (
        "prompts-some-types",
        _prompts(json.dumps({"react_put_0": "a", "react_put_1": "b"})),
        "has no react_clean_0/_1",
    ),
    # 6: refused runs that used to leave a store behind
    ("deadline-tomorrow", _flags("--deadline", "tomorrow"), "bad deadline"),
    ("deadline-empty", _flags("--deadline", ""), "bad deadline"),
    ("step-timeout-nan", _flags("--step-timeout-s", "nan"), "finite"),
    ("escalate-bogus", _flags("--escalate-model", "bogus:x"), "bogus"),
    ("planner-bogus", _flags("--planner-model", "bogus:x"), "bogus"),
    ("reflector-bogus", _flags("--reflect-model", "bogus:x"), "bogus"),
    # 7: NaN, inf and negatives that switched limits off
    ("temperature-nan", _flags("--temperature", "nan"), "finite"),
    ("temperature-inf", _flags("--temperature", "inf"), "finite"),
    ("temperature-negative", _flags("--temperature", "-1"), ">= 0"),
    ("budget-usd-nan", _flags("--budget-usd", "nan"), "finite"),
    ("budget-usd-negative", _flags("--budget-usd", "-1"), ">= 0"),
    ("deadline-nanh", _flags("--deadline", "nanh"), "finite"),
    ("deadline-infh", _flags("--deadline", "infh"), "finite"),
    ("deadline-negative", _flags("--deadline=-5h"), ">= 0"),
    ("task-max-seconds-nan", _flags("--task-max-seconds", "nan"), "finite"),
    ("lats-max-seconds-nan", _flags("--lats-max-seconds", "nan"), "finite"),
    ("lats-temperature-inf", _flags("--lats-temperature", "inf"), "finite"),
    ("env-worker-cpus-nan", _flags("--env-worker-cpus", "nan"), "finite"),
    ("gpus-negative", _flags("--gpus", "-1"), ">= 0"),
    ("temperature-nan-yaml", _yaml("temperature: .nan\n"), "finite"),
    ("budget-inf-yaml", _yaml("budget:\n  budget_usd: .inf\n"), "finite"),
    # 9: YAML values of the wrong type, ports, --resume with another --run-dir
    ("run-dir-list-yaml", _yaml("run_dir: [a, b]\n"), "run_dir must be text"),
    ("game-ids-mapping-yaml", _yaml("game_ids: {a: 1}\n"), "game_ids must be a list"),
    ("backend-options-list-yaml", _yaml("backend_options: [1, 2]\n"), "backend_options must be"),
    ("ray-off-unquoted-yaml", _yaml("ray: off\n"), "quote"),
    ("max-steps-text-yaml", _yaml("max_steps: three\n"), "max_steps must be a whole number"),
    ("serve-port-70000", _flags("--serve-port", "70000"), "serve-port must be <= 65535"),
    ("per-type-huge", _flags("--generate-per-type", "1000000000"), "10000"),
    # issue 37: flag values that are not YAML, URLs that are not URLs, files that are not files
    ("backend-option-not-yaml", _flags("--backend-option", "timeout={a"), "not valid YAML"),
    ("role-option-not-yaml", _flags("--role-option", "reflect.timeout=[1"), "not valid YAML"),
    ("base-url-port-99999", _flags("--base-url", "http://host:99999/v1"), "port in 1-65535"),
    ("base-url-port-0", _flags("--base-url", "http://host:0/v1"), "port in 1-65535"),
    ("base-url-no-scheme", _flags("--base-url", "host:8000/v1"), "http:// or https://"),
    ("base-url-space", _flags("--base-url", "http://host /v1"), "has a space"),
    ("instruction-file-fifo", _fifo("--instruction-file"), "not a regular file"),
    ("prompts-fifo", _fifo("--prompts"), "not a regular file"),
    ("config-fifo", _fifo("--config"), "neither a file nor a preset"),
    ("textworld-task-types", _flags("--env", "textworld", "--task-types", "put"), "ALFWorld task"),
]


def _base(games: Path, run_dir: Path) -> list[str]:
    return [
        "run", "--model", "scripted:expert", "--data", str(games), "--split", SPLIT,
        "--games", "1", "--trials", "1", "--run-dir", str(run_dir),
    ]  # fmt: skip


def _one_error_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("reflexsim: error: "), err
    assert needle in lines[0], err


def _nothing_in(run_dir: Path) -> bool:
    return not run_dir.exists() or not any(run_dir.iterdir())


@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ALFWORLD_DATA"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("flags", "needle"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES]
)
def test_a_bad_run_is_one_line_exit_2_and_writes_nothing(
    flags, needle, generated_games, tmp_path, capsys, no_keys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a run dir made from a bad value would land here
    run_dir = tmp_path / "run"
    args = flags(tmp_path)
    if "--config" in args:  # the file's keys are what is tested: no --run-dir flag over them
        base = [a for a in _base(generated_games, run_dir) if a not in ("--run-dir", str(run_dir))]
    else:
        base = _base(generated_games, run_dir)
    if needle.startswith("has no react_"):  # a file with put only, over games of every type
        base += ["--games", "6"]
    before = set(tmp_path.iterdir())
    code = main([*base, *args])
    _one_error_line(code, capsys.readouterr().err, needle)
    assert _nothing_in(run_dir)
    assert set(tmp_path.iterdir()) == before  # no folder named after a bad value either


def test_ray_without_the_extra_is_refused_before_the_run_dir(
    generated_games, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    run_dir = tmp_path / "run"
    code = main([*_base(generated_games, run_dir), "--ray", "local"])
    _one_error_line(code, capsys.readouterr().err, "reflexsim[ray]")
    assert _nothing_in(run_dir)


@pytest.mark.parametrize(
    "bad",
    [["--deadline", "tomorrow"], ["--escalate-model", "bogus:x"], ["--step-timeout-s", "nan"]],
    ids=["deadline", "escalate", "step-timeout"],
)
def test_the_corrected_command_runs_after_a_refused_one(bad, generated_games, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*_base(generated_games, run_dir), *bad]) == 2
    assert _nothing_in(run_dir)
    capsys.readouterr()
    assert main(_base(generated_games, run_dir)) == 0, capsys.readouterr().err
    assert (run_dir / "run.sqlite").is_file() and (run_dir / "config.yaml").is_file()
    if bad[0] == "--deadline":  # and --resume of it reads back good values only
        assert main(["run", "--resume", str(run_dir)]) == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def a_run(generated_games, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("done") / "run"
    assert main(_base(generated_games, run_dir)) == 0
    return run_dir


def _digest(run_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.iterdir())
        if p.is_file() and p.suffix in (".sqlite", ".yaml")
    }


def test_resume_with_another_run_dir_is_refused(a_run, tmp_path, capsys):
    before = _digest(a_run)
    other = tmp_path / "other"
    code = main(["run", "--resume", str(a_run), "--run-dir", str(other)])
    _one_error_line(code, capsys.readouterr().err, "drop --run-dir")
    assert not other.exists() and _digest(a_run) == before
    # the same folder, spelled either way, is no conflict
    assert main(["run", "--resume", str(a_run), "--run-dir", str(a_run)]) == 0


def test_other_commands_refuse_bad_input_in_one_line(a_run, generated_games, tmp_path, capsys):
    game = next(generated_games.rglob("game.tw-pddl")).parent
    garbage = tmp_path / "garbage" / "json_2.1.1" / "train" / game.parent.name / game.name
    garbage.mkdir(parents=True)
    (garbage / "game.tw-pddl").write_bytes(b"\x00\xffnot a game")
    (garbage / "traj_data.json").write_bytes(b"\x00\xffnot json")
    odd = tmp_path / "odd" / "json_2.1.1" / "train" / game.parent.name / game.name
    odd.mkdir(parents=True)  # JSON, but a number where the walkthrough list belongs
    _write(odd / "game.tw-pddl", json.dumps({"pddl_problem": "(define)", "walkthrough": 3}))
    a_file = _write(tmp_path / "a-file", "x")
    cases = [
        (["export", str(a_run), "--out", str(a_file / "sub")], "pass a writable folder"),
        (["view", str(a_run), "--port", "99999"], "1-65535"),
        (["view", str(a_run), "--port", "-1"], "1-65535"),
        (["games", "generate", "--out", str(tmp_path / "g"), "--per-type", "1000000000"], "10000"),
        (["games", "stats", str(tmp_path / "garbage")], "not an ALFWorld game file"),
        (["games", "stats", str(tmp_path / "odd")], "not an ALFWorld game file"),
    ]
    for args, needle in cases:
        code = main(args)
        _one_error_line(code, capsys.readouterr().err, needle)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("traj", [b"\x00\xffnot json", b'{"task_type": [1]}', b"[1, 2]"])
def test_games_stats_of_one_game_with_a_garbage_traj_data_json(
    traj, generated_games, tmp_path, capsys
):
    """One game (one task type of six) whose traj_data.json is garbage: the stats are printed
    (its task type comes from its folder's name), with "-" where it has no games to compare."""
    from envs.discovery import discover_games

    game = next(generated_games.rglob("game.tw-pddl")).parent
    one = tmp_path / "one" / "json_2.1.1" / "train" / game.parent.name / game.name
    shutil.copytree(game, one)
    (one / "traj_data.json").write_bytes(traj)
    assert main(["games", "stats", str(tmp_path / "one")]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "games" in out and "TV " in out
    assert [g.game_id for g in discover_games(tmp_path / "one", "train")] == [
        one.relative_to(tmp_path / "one").as_posix()
    ]


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns("run.lock"))
    return to


def test_a_report_that_cannot_be_written_is_one_line_naming_out(a_run, tmp_path, capsys):
    run = _copy(a_run, tmp_path / "run")
    summary = run / "report" / "summary.json"
    summary.parent.mkdir(exist_ok=True)
    summary.unlink(missing_ok=True)
    summary.mkdir()  # in the way: its write fails as on a read-only mount
    code = main(["report", str(run)])
    _one_error_line(code, capsys.readouterr().err, f"{summary} (Is a directory): pass --out DIR")
    elsewhere = tmp_path / "elsewhere"
    assert main(["report", str(run), "--out", str(elsewhere)]) == 0
    assert (elsewhere / "summary.json").is_file()


def test_report_of_a_run_on_a_read_only_mount(a_run, tmp_path):
    """A real read-only mount (a user and mount namespace: skipped where there are none): the
    report is refused in one line naming the file and --out; --out elsewhere writes it."""
    run = _copy(a_run, tmp_path / "run")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no user namespaces to mount a folder read-only")
    q = lambda p: shlex.quote(str(p))  # noqa: E731
    cli = f"{q(sys.executable)} -m experiments.cli report {q(run)}"
    script = (
        f"mount --bind {q(run)} {q(run)} && mount -o remount,bind,ro {q(run)} && "
        f"{cli}; echo rc=$?; {cli} --out {q(tmp_path / 'out')}; echo rc=$?"
    )
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.splitlines()[0] == "rc=2" and r.stdout.splitlines()[-1] == "rc=0", r.stdout
    assert "Read-only file system): pass --out DIR" in r.stderr, r.stderr
    assert (tmp_path / "out" / "summary.json").is_file()


def test_a_closed_pipe_ends_replay_quietly(a_run):
    """``reflexsim replay ... | head``: the reader goes away; exit 141 (128 + SIGPIPE), no
    traceback (the Python docs' recipe: stdout pointed at devnull)."""
    from experiments.store import RunStore

    store = RunStore(a_run, readonly=True)
    try:
        game = store.episodes()[0].game
    finally:
        store.close()
    code = "import sys; from experiments.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "replay", str(a_run), "--game", game],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child writes a line: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141), err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _viewer(run_dir: Path, **streams: Any) -> subprocess.Popen[bytes]:
    code = "import sys; from experiments.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "view", str(run_dir), "--port", "0"], cwd=ROOT, **streams
    )


def _first_line(proc: subprocess.Popen[bytes]) -> bytes:
    """The viewer's first line (its URL), read as soon as it is written (a hang guard, not a
    timing: the line comes in seconds)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "the viewer printed no line (left in its buffer?)"
    return proc.stdout.readline()


def test_a_viewer_whose_reader_went_away_ends_quietly_on_ctrl_c(a_run):
    """``reflexsim view RUN 2>&1 | head -1``, then Ctrl-C: the one line comes at once, and the
    end writes nothing into the closed pipe (no BrokenPipeError, exit 130)."""
    proc = _viewer(a_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert b"serving" in _first_line(proc)
        assert proc.stdout is not None
        proc.stdout.close()  # head -1 has its line and goes
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130  # a traceback at exit would be 1 or 120
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_on_the_viewer_ends_it_quietly(a_run):
    """Ctrl-C is how a viewer stops: exit 130, and no run's resume message (nothing to resume)."""
    proc = _viewer(a_run, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert b"serving" in _first_line(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert b"resume" not in err and b"Traceback" not in err, err


# -- a refused run leaves its folder as it found it --------------------------------------------
def test_extract_of_a_folder_without_a_run_makes_nothing_there(tmp_path, capsys):
    missing = tmp_path / "no" / "such"
    code = main(["extract", str(missing), "--model", "scripted:expert"])
    _one_error_line(code, capsys.readouterr().err, "not a run directory")
    assert not (tmp_path / "no").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["extract", str(empty), "--model", "scripted:expert"])
    _one_error_line(code, capsys.readouterr().err, "not a run directory")
    assert list(empty.iterdir()) == []  # no run.lock


def _taken_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, int(s.getsockname()[1])


# (id, the server command, what the error line names, what the log it names holds)
SERVE_FAILURES = [
    ("program-not-found", "no-such-server-program --port {port}", "not found on PATH", None),
    (
        "exits",
        "{python} -c \"import sys; print('out of memory (pretend)'); sys.exit(3)\" {port}",
        "exited with code 3 before it was ready",
        "out of memory (pretend)",
    ),
    (
        "never-healthy",
        "{python} -c \"import time; print('loading (pretend)', flush=True); time.sleep(600)\" {port}",
        "was not ready after 2s",
        "loading (pretend)",
    ),
    ("port-in-use", "{python} -c pass {port}", "in use by another program", None),
]


@pytest.mark.parametrize(
    ("command", "needle", "logged"), [f[1:] for f in SERVE_FAILURES], ids=[f[0] for f in SERVE_FAILURES]
)  # fmt: skip
@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "empty-folder"])
def test_a_server_that_does_not_start_leaves_the_run_folder_as_found(
    command, needle, logged, existing, generated_games, tmp_path, capsys
):
    """No run.lock, server.log or server.pid stays: the folders the run made go, an existing one
    is left empty; a server log with something in it is moved out, and the error names it."""
    run_dir = tmp_path / "runs" / "run"
    if existing:
        run_dir.mkdir(parents=True)
    taken, port = _taken_port()
    if not needle.startswith("in use"):
        taken.close()  # free again: the server's port
    try:
        code = main([
            *_base(generated_games, run_dir), "--model", "vllm:fault-model", "--serve",
            "--serve-command", command, "--serve-port", str(port), "--serve-timeout-s", "2",
        ])  # fmt: skip
    finally:
        taken.close()
    line = capsys.readouterr().err
    _one_error_line(code, line, needle)
    assert (list(run_dir.iterdir()) == []) if existing else not (tmp_path / "runs").exists()
    if logged is not None:
        log = Path(line.split("; see ")[-1].strip())
        assert log.parent == Path(tempfile.gettempdir()), line
        assert logged in log.read_text()
        log.unlink()


def test_an_experience_source_that_cannot_be_locked_leaves_the_run_folder_as_found(
    train_games, generated_games, tmp_path, capsys
):
    """The extract phase locks the gathering run to keep its rules there; where it cannot (a
    read-only mount; here its lock file's place is taken by a folder), the run is refused in one
    line and its own folder is gone again."""
    from tests.experiments.test_experience_phases import HEAT, gather

    source = gather(train_games, tmp_path, trials=2)
    (source / "run.lock").unlink()
    (source / "run.lock").mkdir()
    run_dir = tmp_path / "eval"
    code = main([
        *_base(generated_games, run_dir), "--model", "scripted:learner", "--agent", "insights",
        "--experience-from", str(source), "--task-types", *HEAT, "--max-steps", "8",
    ])  # fmt: skip
    _one_error_line(code, capsys.readouterr().err, "use a folder you can write to")
    assert not run_dir.exists()


def test_sigterm_in_the_extract_phase_says_what_to_run_and_leaves_nothing(
    train_games, generated_games, tmp_path
):
    """SIGTERM while the rules are being made (the reflector's answer never comes): exit 143,
    and the line says to run the command again (no --resume: the folder holds no store, and is
    gone)."""
    from tests.experiments.test_experience_phases import HEAT, gather
    from tests.support.fault_server import FaultPlan, FaultServer

    source = gather(train_games, tmp_path, trials=2)
    run_dir = tmp_path / "eval"
    with FaultServer(FaultPlan(delay=lambda text: 600.0)) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.cli", *_base(generated_games, run_dir),
             "--model", "scripted:learner", "--agent", "insights", "--experience-from",
             str(source), "--task-types", *HEAT, "--reflect-model", "openai:test",
             "--role-option", f"reflect.base_url={server.url}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120  # a hang guard: the first request comes in seconds
            while not server.events and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.events, proc.communicate(timeout=60)[1][-3000:]
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "--resume" not in err, err[-3000:]
    assert "interrupted (SIGTERM): before the run began" in err and "run the same command" in err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "name", sorted(n for n, (s, _) in leaves().items() if _base_type(_hints(s)[n]) is float)
)
def test_no_float_key_takes_nan_or_infinity(name):
    for value in (math.nan, math.inf, -math.inf, "nan"):
        with pytest.raises(ConfigError, match="finite"):
            from_mapping({name: value})
    default = getattr(RunConfig().section(leaves()[name][0]), name)
    assert default is None or math.isfinite(default)


def test_a_bad_flag_on_a_matrix_preset_leaves_no_folder(tmp_path, capsys):
    run_dir = tmp_path / "matrix"
    code = main(["run", "--config", "arms-cpu", "--temperature", "nan", "--run-dir", str(run_dir)])
    _one_error_line(code, capsys.readouterr().err, "finite")
    assert not run_dir.exists()
