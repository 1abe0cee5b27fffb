"""``--harness-procs 2 --harness-procs-on-ray`` on a real local Ray cluster: the runner processes
are Ray actors on the run's node, the run's episodes are a one-process run's, and a runner actor
killed with ``kill -9`` ends the run as crashed, naming it, and SIGTERM to the job stops the
actors (which are outside its process group) as interrupted; after either, ``--resume`` gives
the uninterrupted run's store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from experiments.cli import main
from tests.experiments.test_shards import killed_then_resumed, procs_event, stopped_then_resumed
from tests.experiments.test_signals import args_of, assert_same_store, state_of
from tests.support.raycluster import ray_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with ray_cluster({"num_cpus": 2}) as c:
        yield c


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
    where = procs_event(run_dir)
    assert len(where["pids"]) == 2
    import ray  # lazily: the cluster fixture skips this module without Ray

    assert where["ray_node"] == ray.get_runtime_context().get_node_id()  # the store's node


def test_sigterm_to_the_job_stops_the_runner_actors_and_resume_finishes_it(
    cluster, generated_games, one_process, tmp_path
):
    # the actors are not in the job's process group: the runner stops them
    stopped_then_resumed(generated_games, one_process, tmp_path / "run", _on_ray(cluster))


def test_a_runner_actor_killed_ends_the_run_as_crashed_and_resume_finishes_it(
    cluster, generated_games, one_process, tmp_path
):
    # the resume runs on Ray again: this process's cluster
    killed_then_resumed(
        generated_games, one_process, tmp_path / "run", _on_ray(cluster),
        "runner process 1 of 2 died (its Ray actor died)",
    )  # fmt: skip
