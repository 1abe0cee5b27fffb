"""One run over several runner processes (``--harness-procs N``): the same episodes as one process,
one store; a runner process killed with ``kill -9`` ends the run as crashed, naming it, and
``--resume`` gives the uninterrupted run's store; SIGTERM to the job interrupts it like a
one-process run; budgets count every process's calls; what N processes cannot play as one run is
a one-line error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from experiments import shards
from experiments.cli import main
from experiments.store import RunStore
from experiments.trials import Task
from tests.experiments.test_signals import (
    args_of,
    assert_same_store,
    start,
    state_of,
    wait_for_steps,
)


def procs_event(run_dir: Path) -> dict[str, Any]:
    """What the run recorded of its runner processes (their pids, tasks, where), or {}."""
    store = RunStore(run_dir, readonly=True)
    try:
        events = store.events("harness_procs")
    finally:
        store.close()
    return dict(json.loads(events[-1]["detail"])) if events else {}


def _pids(run_dir: Path) -> list[int]:
    return list(procs_event(run_dir).get("pids", []))


def test_two_processes_play_the_same_run_as_one(generated_games, one_process, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", *args_of(generated_games), "--harness-procs", "2",
                 "--run-dir", str(run_dir)]) == 0  # fmt: skip
    assert state_of(run_dir).complete
    assert_same_store(one_process, run_dir)
    assert len(_pids(run_dir)) == 2
    store = RunStore(run_dir, readonly=True)
    try:
        assert all(t["finished_at"] is not None for t in store.trials())
        assert [e["kind"] for e in store.events() if e["episode_id"] is None][-1] == "end"
    finally:
        store.close()


def killed_then_resumed(games: Path, one: Path, run_dir: Path, flags: list[str], says: str) -> None:
    """A run on ``flags`` whose first runner process is killed (``kill -9``) ends as crashed,
    saying ``says``; ``--resume`` (in this process) gives ``one``'s store."""
    proc = start(*args_of(games), *flags, "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    pids = _pids(run_dir)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    assert says in err and "--resume" in err
    assert "Traceback" not in err
    state = state_of(run_dir)
    assert not state.complete and state.ended == "crashed"
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert state_of(run_dir).complete
    assert_same_store(one, run_dir)


def stopped_then_resumed(games: Path, one: Path, run_dir: Path, flags: list[str]) -> None:
    """A run on ``flags`` whose job gets SIGTERM ends as interrupted; ``--resume`` (in this
    process) gives ``one``'s store."""
    proc = start(*args_of(games), *flags, "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    assert state_of(run_dir).ended == "interrupted"
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert_same_store(one, run_dir)


def test_a_runner_process_killed_ends_the_run_as_crashed_and_resume_finishes_it(
    generated_games, one_process, tmp_path
):
    killed_then_resumed(
        generated_games, one_process, tmp_path / "run", ["--harness-procs", "2"],
        "runner process 1 of 2 died (killed by SIGKILL)",
    )  # fmt: skip


def test_sigterm_to_the_job_interrupts_every_process_and_resume_finishes_it(
    generated_games, one_process, tmp_path
):
    stopped_then_resumed(generated_games, one_process, tmp_path / "run", ["--harness-procs", "2"])


def test_the_parent_killed_leaves_no_board_and_resume_finishes_it(
    generated_games, one_process, tmp_path, monkeypatch
):
    """The board the processes share leaves the temporary folder once every process has mapped
    it (the parent hears so within a moment of their start), so ``kill -9`` of the run's own
    process leaves nothing there; its runner processes end with it, and ``--resume`` gives the
    uninterrupted run's store."""
    # the run's, inherited; short: multiprocessing's forkserver puts a socket in it, and a
    # socket's path must stay under ~108 characters
    temp = Path(tempfile.mkdtemp(prefix="rs-"))
    monkeypatch.setenv("TMPDIR", str(temp))
    run_dir = tmp_path / "run"
    proc = start(*args_of(generated_games), "--harness-procs", "2", "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    deadline = time.monotonic() + 60
    while list(temp.glob("reflexsim-shards-*")):  # the parent reads the processes' word
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the board was still there 60 s into the run"
        time.sleep(0.02)
    pids = _pids(run_dir)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, "a runner process outlived its parent by 60 s"
        time.sleep(0.05)
    assert not list(temp.glob("reflexsim-shards-*"))
    shutil.rmtree(temp, ignore_errors=True)
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert_same_store(one_process, run_dir)


def test_a_token_budget_counts_every_process(generated_games, tmp_path):
    run_dir = tmp_path / "run"
    budget = 3000
    assert main(["run", *args_of(generated_games), "--harness-procs", "2", "--budget-tokens",
                 str(budget), "--run-dir", str(run_dir)]) == 0  # fmt: skip
    state = state_of(run_dir)
    assert not state.complete and "token budget" in (state.stopped or "")
    store = RunStore(run_dir, readonly=True)
    try:
        used = store.token_totals().total
        biggest = max(c.prompt_tokens + c.completion_tokens for c in store.model_calls())
    finally:
        store.close()
    # each process stops at its next call once the run's total is reached: at most the calls
    # in flight (--concurrency 3) pass it
    assert budget <= used <= budget + 3 * biggest


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--model", "embedded"], "serve it"),
        (["--protocol", "reflexion-code"], "use --harness-procs 1"),
        (["--concurrency", "1"], "--concurrency 2 or more"),
        (["--harness-procs-on-ray"], "--harness-procs-on-ray needs --ray"),
    ],
    ids=["in-process model", "paper code protocol", "too few in flight", "on Ray without Ray"],
)
def test_what_several_processes_cannot_play_is_one_line(
    generated_games, tmp_path, capsys, flags, says
):
    run_dir = tmp_path / "run"
    code = main(["run", *args_of(generated_games), "--harness-procs", "2", *flags,
                 "--run-dir", str(run_dir)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not run_dir.exists()


def test_tasks_are_dealt_round_robin_and_places_split_evenly():
    tasks = [Task(f"g{i}", "put") for i in range(5)]
    assert [[t.game for t in part] for part in shards.deal(tasks, 2)] == [
        ["g0", "g2", "g4"],
        ["g1", "g3"],
    ]
    assert len(shards.deal(tasks[:1], 3)) == 1  # no process without a task
    assert [shards.share(7, 3, i) for i in range(3)] == [3, 2, 2]
    assert [shards.share(1, 2, i) for i in range(2)] == [1, 1]  # at least one each
