"""A night that loses nothing: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) mid-run end
with 143 / 130 and leave the run (or the preset job it was in) ``interrupted``, never complete;
``--resume`` plays the rest, to the same store as an uninterrupted run. One writer per run or
matrix directory: a second is a one-line error naming the live one. A run that ends with tasks
left by infrastructure errors exits 3, and ``--resume`` retries them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import matrix
from experiments.cli import main
from experiments.store import RunStore
from tests.experiments.test_runner import ROOT, SPLIT, snapshot, steps_written
from tests.support.fault_server import FaultPlan, FaultServer


def args_of(games: Path, n: int = 4) -> list[str]:
    return ["--model", "scripted:learner", "--data", str(games), "--split", SPLIT, "--games",
            str(n), "--trials", "2", "--max-steps", "20", "--workers", "2", "--concurrency", "3"]  # fmt: skip


def preset_of(games: Path, tmp: Path, n: int = 3) -> Path:
    """A preset-like matrix: two small jobs (Reflexion, then ReAct) on the scripted learner."""
    path = tmp / "two.yaml"
    path.write_text(
        "description: two small jobs\n"
        f"base: {{data: {games}, split: {SPLIT}, games: {n}, trials: 2, max_steps: 20,"
        " workers: 2, concurrency: 3, model: 'scripted:learner'}\n"
        "jobs:\n"
        "  - {name: first, agent: reflexion}\n"
        "  - {name: second, agent: react}\n"
    )
    return path


def start(*args: str) -> subprocess.Popen[str]:
    """``reflexsim run ...`` in its own process group (a terminal's Ctrl-C, or a scheduler,
    signals every process of the job: the runner and its env workers)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run_alfworld.py"), *args], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def wait_for_steps(proc: subprocess.Popen[str], run_dir: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while steps_written(run_dir) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run wrote no step in 120 s"
        time.sleep(0.02)


def state_of(run_dir: Path):
    store = RunStore(run_dir, readonly=True)
    try:
        return store.run_state()
    finally:
        store.close()


def assert_same_store(a: Path, b: Path) -> None:
    """As the kill -9 test compares: episodes, steps and reflections identical, no step twice."""
    x, y = snapshot(a), snapshot(b)
    assert y["rows"][0] == y["rows"][1]
    assert x["episodes"] == y["episodes"]
    assert x["steps"] == y["steps"]
    assert x["reflections"] == y["reflections"]


@pytest.fixture(scope="module")
def reference(generated_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted runs: a single run in ``single``, the matrix in ``matrix``."""
    root = tmp_path_factory.mktemp("reference")
    assert main(["run", *args_of(generated_games), "--run-dir", str(root / "single")]) == 0
    preset = preset_of(generated_games, root)
    assert main(["run", "--config", str(preset), "--run-dir", str(root / "matrix")]) == 0
    return root


SIGNALS = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]


@pytest.mark.parametrize(("sig", "code"), SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_leaves_it_interrupted_and_resume_finishes_it(
    sig, code, generated_games, reference, tmp_path
):
    run_dir = tmp_path / "run"
    proc = start(*args_of(generated_games), "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    state = state_of(run_dir)
    assert state.status == "interrupted" and not state.complete and state.ended == "interrupted"
    assert state.finished < state.tasks
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert state_of(run_dir).complete
    assert_same_store(reference / "single", run_dir)


@pytest.mark.parametrize(("sig", "code"), SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_job_stops_the_preset_run_and_resume_plays_every_remaining_episode(
    sig, code, generated_games, reference, tmp_path, capsys
):
    root = tmp_path / "m"
    proc = start("--config", str(preset_of(generated_games, tmp_path)), "--run-dir", str(root))
    wait_for_steps(proc, root / "first", 3)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err
    # the job it was in is interrupted, not complete; the next one never started
    assert matrix.job_status(root / "first") == "interrupted"
    assert matrix.job_status(root / "second") == "new"
    jobs = json.loads((root / "matrix.json").read_text())["jobs"]
    assert jobs["first"]["status"] == "interrupted" and "second" not in jobs
    assert main(["run", "--resume", str(root)]) == 0
    out = capsys.readouterr().out
    assert "first: complete" in out and "second: complete" in out
    for job in ("first", "second"):
        assert matrix.job_status(root / job) == "complete"
        assert_same_store(reference / "matrix" / job, root / job)


def test_one_writer_per_run_directory(generated_games, tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = start(*args_of(generated_games, 6), "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 1)
    fresh = main(["run", *args_of(generated_games, 6), "--run-dir", str(run_dir)])
    fresh_err = capsys.readouterr().err.strip()
    resumed = main(["run", "--resume", str(run_dir)])
    resumed_err = capsys.readouterr().err.strip()
    assert proc.poll() is None, "the first run ended before the second could start"
    for code, err in ((fresh, fresh_err), (resumed, resumed_err)):
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("reflexsim: error: ") and f"pid {proc.pid}" in err, err
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Error" not in err, err[-3000:]
    assert state_of(run_dir).complete
    snap = snapshot(run_dir)
    assert snap["rows"][0] == snap["rows"][1] and len(snap["episodes"]) == 12
    assert {e[2] for e in snap["episodes"].values()} == {"done"}


def test_one_preset_run_per_matrix_directory(generated_games, tmp_path, capsys):
    root = tmp_path / "m"
    preset = preset_of(generated_games, tmp_path, 6)
    proc = start("--config", str(preset), "--run-dir", str(root))
    wait_for_steps(proc, root / "first", 1)
    fresh = main(["run", "--config", str(preset), "--run-dir", str(root)])
    fresh_err = capsys.readouterr().err.strip()
    resumed = main(["run", "--resume", str(root)])
    resumed_err = capsys.readouterr().err.strip()
    assert proc.poll() is None, "the first preset run ended before the second could start"
    for code, err in ((fresh, fresh_err), (resumed, resumed_err)):
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"in use by a preset run (pid {proc.pid}" in err, err
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "first: complete" in out and "second: complete" in out
    assert {j["status"] for j in json.loads((root / "matrix.json").read_text())["jobs"].values()} == {"complete"}  # fmt: skip


def _look(prompt: str) -> str:
    return " look"


def test_a_run_whose_episodes_all_end_as_infrastructure_errors_exits_3(
    generated_games, tmp_path, capsys
):
    config = tmp_path / "run.yaml"
    with FaultServer(FaultPlan(rate=1.0, kinds=("500",)), answer=_look) as broken:
        config.write_text(
            f"model: 'openai:test'\nbase_url: '{broken.url}'\ndata: '{generated_games}'\n"
            f"split: {SPLIT}\ngames: 2\ntrials: 1\nmax_steps: 6\n"
            "backend_options: {max_retries: 0, timeout: 5, backoff_base: 0.01, jitter: 0.0}\n"
        )
        run_dir = tmp_path / "run"
        code = main(["run", "--config", str(config), "--run-dir", str(run_dir)])
        port = broken.port
    out = capsys.readouterr().out
    assert code == 3, out
    assert f"--resume {run_dir}" in out and "infrastructure errors" in out
    state = state_of(run_dir)
    assert state.status == "errors" and state.errors == 2 and state.finished == 0
    # the server is back: --resume retries them, and the run is complete
    with FaultServer(FaultPlan(), answer=_look, port=port):
        assert main(["run", "--resume", str(run_dir)]) == 0
    state = state_of(run_dir)
    assert state.complete and state.errors == 0


def test_a_preset_job_left_with_infrastructure_errors_makes_the_preset_run_exit_3(
    generated_games, tmp_path, capsys
):
    preset = tmp_path / "one.yaml"
    with FaultServer(FaultPlan(rate=1.0, kinds=("500",)), answer=_look) as broken:
        preset.write_text(
            "description: a model server that fails every request\n"
            f"base: {{data: '{generated_games}', split: {SPLIT}, games: 1, trials: 1,"
            f" max_steps: 6, model: 'openai:test', base_url: '{broken.url}',"
            " backend_options: {max_retries: 0, timeout: 5, backoff_base: 0.01}}\n"
            "jobs:\n"
            "  - {name: only, agent: react}\n"
        )
        root = tmp_path / "m"
        code = main(["run", "--config", str(preset), "--run-dir", str(root)])
    out = capsys.readouterr().out
    assert code == 3, out
    assert "only: errors" in out and "infrastructure errors" in out
    job = json.loads((root / "matrix.json").read_text())["jobs"]["only"]
    assert job["status"] == "errors" and "--resume" in job["error"]
