"""Env workers as Ray actors on a real two-node Ray cluster: the local pool's answers and failure
semantics (a killed actor is replaced and its episode re-simulated; a hung one times out), and
whole runs whose episodes equal the local pool's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.pool import EnvSpec, Reset, WorkerCrashed
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.session import run
from experiments.store import RunStore
from memory.records import EnvReply
from tests.conftest import FULL_CHECKS
from tests.experiments.test_runner import snapshot
from tests.support.raycluster import ray_cluster

RAY_GAMES = 40 if FULL_CHECKS else 16

SPLIT = "eval_out_of_distribution"
# the pool tests' cheap env, imported by the actors from the checkout (see tests/envs/test_pool.py)
SLEEPY = EnvSpec("tests.envs.test_pool:SleepyEnv")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with ray_cluster({"num_cpus": 1}, {"num_cpus": 1}) as c:
        yield c


def test_actors_spread_over_the_nodes_answer_like_workers_and_are_replaced(cluster):
    import ray

    from envs.ray_pool import RayEnvPool

    with RayEnvPool(SLEEPY, workers=2, timeout_s=8) as pool:
        started = pool.reset_many({0: Reset("a"), 1: Reset("b")})
        assert all(isinstance(r, EnvReply) for r in started.values()), started
        assert {r.observation for r in started.values()} == {"awake"}  # type: ignore[union-attr]
        assert pool.step(0, "heavy").observation == ""  # nothing heavy imported in an actor
        assert pool.step(1, "wave").info["steps"] == 1
        nodes = {p["node_id"] for p in pool.placement()}
        assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # one actor per node
        with pytest.raises(RuntimeError, match="the env broke"):  # the env's own error
            pool.step(1, "fail")

        dead = pool.actor(1)
        ray.kill(dead)  # the actor dies (as when its node goes away); ray.kill returns at once,
        _wait_dead(ray, dead)  # so wait until it is gone before the next call reaches it
        results = pool.step_many({0: "wave", 1: "dance"})
        crash = results[1]
        assert isinstance(crash, WorkerCrashed) and "Ray env worker 1" in crash.reason
        assert (crash.slot, crash.actions, crash.pending, crash.game) == (
            1,
            ("wave",),
            "dance",
            "b",
        )
        assert isinstance(results[0], EnvReply) and results[0].info["steps"] == 2
        assert pool.restarts == 1
        replayed = pool.reset(1, crash.game, replay=crash.actions)  # re-simulated on a new actor
        assert replayed.info["steps"] == 1
        assert pool.step(1, crash.pending).info["steps"] == 2

        # a hung call times out: the actor is replaced, the slot's episode is lost until reset
        results = pool.step_many({0: "sleep 60", 1: "wave"})
        assert isinstance(results[0], WorkerCrashed) and "timed out" in results[0].reason
        assert results[0].actions == ("heavy", "wave") and results[0].pending == "sleep 60"
        assert isinstance(results[1], EnvReply)
        with pytest.raises(WorkerCrashed):
            pool.step(0, "wave")
        assert pool.reset(0, "a", replay=("wave",)).info["steps"] == 1
    assert pool.restarts == 2


def _wait_dead(ray: Any, actor: Any, timeout_s: float = 30.0) -> None:
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.where.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def _config(games: Path, run_dir: Path, **kw: Any) -> RunConfig:
    values = {
        "model": "scripted:learner", "data": str(games), "split": SPLIT, "games": 3,
        "trials": 2, "workers": 2, "concurrency": 2, "run_dir": str(run_dir),
    }  # fmt: skip
    return RunConfig.of(**{**values, **kw})


def test_a_run_on_ray_env_workers_equals_the_local_pool_even_when_an_actor_dies(
    cluster, generated_games, tmp_path, monkeypatch
):
    import ray

    from envs import ray_pool

    local = run(_config(generated_games, tmp_path / "local"))

    pools: list[Any] = []
    killed: list[str] = []
    submit = ray_pool.RayEnvPool.submit

    def kill_then_submit(self: Any, calls: dict[int, Any]) -> None:
        # slot 0's actor dies just as its episode sends a third action: mid-episode for sure
        if not killed and isinstance(calls.get(0), str) and len(self.actions(0)) >= 2:
            pools.append(self)
            killed.append(self.placement()[0]["node_id"])
            ray.kill(self.actor(0))
        submit(self, calls)

    monkeypatch.setattr(ray_pool.RayEnvPool, "submit", kill_then_submit)
    cfg = _config(generated_games, tmp_path / "ray", ray=cluster.address, env_workers_on_ray=True)
    on_ray = run(cfg)

    assert snapshot(on_ray) == snapshot(local)
    assert killed and pools[0].restarts >= 1
    store = RunStore(on_ray, readonly=True)
    try:
        assert store.event_counts().get("worker_crash", 0) >= 1
        assert any(e.resimulated for e in store.episodes())
    finally:
        store.close()
    assert ray.is_initialized()  # a run does not disconnect a connection it did not make


def test_ray_options_need_ray_and_say_so_in_one_line():
    with pytest.raises(ConfigError, match="--env-workers-on-ray needs --ray"):
        RunConfig.of(env_workers_on_ray=True)
    with pytest.raises(ConfigError, match="--serve-replicas 2 starts servers on a Ray cluster"):
        RunConfig.of(serve_replicas=2)


@pytest.mark.slow
def test_valid_seen_games_on_ray_env_workers_equal_the_local_pool(cluster, alfworld_data, tmp_path):
    # 16 games (40 with REFLEXSIM_FULL_CHECKS=1); each game's first reset is most of the cost
    kw = {
        "model": "scripted:expert", "data": str(alfworld_data), "split": "eval_in_distribution",
        "games": RAY_GAMES, "trials": 1, "workers": 2, "concurrency": 4,
    }  # fmt: skip
    local = run(RunConfig.of(**kw, run_dir=str(tmp_path / "local")))
    cfg = RunConfig.of(
        **kw, run_dir=str(tmp_path / "ray"), ray=cluster.address, env_workers_on_ray=True
    )
    on_ray = run(cfg)
    assert snapshot(on_ray) == snapshot(local)
    assert len(snapshot(local)["episodes"]) == RAY_GAMES
