"""``--harness-procs 2 --harness-procs-on-ray`` on a real local Ray cluster: the runner processes
are Ray actors on the run's node, the run's episodes are a one-process run's, and a runner actor
killed with ``kill -9`` ends the run as crashed, naming it, and SIGTERM to the job stops the
actors (which are outside its process group) as interrupted; after either, ``--resume`` gives
the uninterrupted run's store."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from experiments.cli import main
from experiments.store import RunStore
from tests.experiments.test_shards import _pids
from tests.experiments.test_signals import (
    args_of,
    assert_same_store,
    start,
    state_of,
    wait_for_steps,
)
from tests.support.raycluster import ray_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with ray_cluster({"num_cpus": 2}) as c:
        yield c


@pytest.fixture(scope="module")
def one_process(generated_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert main(["run", *args_of(generated_games), "--run-dir", str(run_dir)]) == 0
    return run_dir


def _on_ray(cluster: Any) -> list[str]:
    return ["--harness-procs", "2", "--harness-procs-on-ray", "--ray", cluster.address]


def test_ray_actors_play_the_same_run_as_one_process(
    cluster, generated_games, one_process, tmp_path
):
    run_dir = tmp_path / "run"
    assert main(["run", *args_of(generated_games), *_on_ray(cluster),
                 "--run-dir", str(run_dir)]) == 0  # fmt: skip
    assert state_of(run_dir).complete
    assert_same_store(one_process, run_dir)
    assert len(_pids(run_dir)) == 2
    store = RunStore(run_dir, readonly=True)
    try:
        where = json.loads(store.events("harness_procs")[-1]["detail"])
    finally:
        store.close()
    import ray  # lazily: the cluster fixture skips this module without Ray

    assert where["ray_node"] == ray.get_runtime_context().get_node_id()  # the store's node


def test_sigterm_to_the_job_stops_the_runner_actors_and_resume_finishes_it(
    cluster, generated_games, one_process, tmp_path
):
    run_dir = tmp_path / "run"
    proc = start(*args_of(generated_games), *_on_ray(cluster), "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    os.killpg(proc.pid, signal.SIGTERM)  # the actors are not in the job's process group
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    assert state_of(run_dir).ended == "interrupted"
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert_same_store(one_process, run_dir)


def test_a_runner_actor_killed_ends_the_run_as_crashed_and_resume_finishes_it(
    cluster, generated_games, one_process, tmp_path
):
    run_dir = tmp_path / "run"
    proc = start(*args_of(generated_games), *_on_ray(cluster), "--run-dir", str(run_dir))
    wait_for_steps(proc, run_dir, 3)
    pids = _pids(run_dir)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    assert "runner process 1 of 2 died (its Ray actor died)" in err and "--resume" in err
    assert "Traceback" not in err
    state = state_of(run_dir)
    assert not state.complete and state.ended == "crashed"
    assert main(["run", "--resume", str(run_dir)]) == 0  # on Ray again: this process's cluster
    assert state_of(run_dir).complete
    assert_same_store(one_process, run_dir)
