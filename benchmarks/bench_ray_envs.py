"""Env workers as Ray actors against the local worker processes, side by side in one run.

Three measurements, each a median of repeats, the two pools alternating so that both see the
same machine load:

- the transport alone: an env that only echoes (``tests/envs/test_pool.py``'s ``SleepyEnv``), one
  slot, ``--calls`` steps one after another, on the local pool (a worker process, a pipe) and on
  the Ray pool (an actor on the local Ray cluster): the Ray pool's overhead per env call;
- the same with a real ALFWorld game (``look``), where the game's own work is in each call;
- a whole run: ``scripted:expert`` on the first ``--games`` valid_seen games, one trial,
  ``--workers`` env workers, ``--concurrency`` episodes in flight; printed as wall times, their
  ratio and the Ray run's extra wall time per env call (resets and actions), and whether both
  runs recorded the same episodes (``tests/experiments/test_runner.py``'s snapshot).

Ray runs on a private local cluster (``--ray local``), started before the clock runs.

    python benchmarks/bench_ray_envs.py [--data DIR] [--games 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs.pool import EnvPool, EnvSpec  # noqa: E402
from envs.ray_pool import RayEnvPool  # noqa: E402
from experiments.config import RunConfig  # noqa: E402
from experiments.games import select_games  # noqa: E402
from experiments.ray_session import connect  # noqa: E402
from experiments.session import run  # noqa: E402
from experiments.store import RunStore  # noqa: E402
from tests.experiments.test_runner import snapshot  # noqa: E402

SPLIT = "eval_in_distribution"


ECHO = EnvSpec("tests.envs.test_pool:SleepyEnv")


def round_trip(spec: EnvSpec, kind: str, game: str, action: str, calls: int) -> float:
    """Median seconds of one step on a started game, the steps sent one after another."""
    pool: Any = (
        EnvPool(spec, workers=1, timeout_s=120)
        if kind == "local"
        else RayEnvPool(spec, workers=1, timeout_s=120)
    )
    with pool:
        pool.reset(0, game)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            pool.step(0, action)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def compare(label: str, trips: dict[str, list[float]], repeats: int, calls: int) -> None:
    local, ray = (statistics.median(trips[k]) for k in ("local", "ray"))
    print(
        f"{label}, median of {repeats} x {calls}: local pool {local * 1e3:.2f} ms, Ray pool "
        f"{ray * 1e3:.2f} ms; Ray overhead {(ray - local) * 1e3:+.2f} ms per call "
        f"({ray / local:.2f}x)"
    )


def env_calls(run_dir: Path) -> int:
    """Resets (one per episode) and actions sent to the env."""
    store = RunStore(run_dir, readonly=True)
    try:
        episodes = store.episodes()
        acts = sum(1 for e in episodes for s in store.steps(e.episode_id) if s.kind.value == "act")
        return len(episodes) + acts
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("ALFWORLD_DATA"))
    sizes = {"games": 40, "workers": 2, "concurrency": 4, "calls": 200, "repeats": 3}
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if not args.data:
        raise SystemExit("set $ALFWORLD_DATA or pass --data DIR (the real ALFWorld games)")
    base = {
        "model": "scripted:expert", "data": args.data, "split": SPLIT, "games": args.games,
        "trials": 1, "workers": args.workers, "concurrency": args.concurrency,
    }  # fmt: skip
    games = select_games(RunConfig.of(**base))
    spec = EnvSpec(games.env_kind, games.env_kwargs)
    first = games.tasks[0].game
    connect("local")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-envs-"))

    echo: dict[str, list[float]] = {"local": [], "ray": []}
    trips: dict[str, list[float]] = {"local": [], "ray": []}
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    same, calls = True, 0
    for repeat in range(args.repeats):
        order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")
        for kind in order:
            echo[kind].append(round_trip(ECHO, kind, "a", "wave", args.calls))
            trips[kind].append(round_trip(spec, kind, first, "look", args.calls))
        dirs = {}
        for kind in order:
            extra = {"ray": "local", "env_workers_on_ray": True} if kind == "ray" else {}
            dirs[kind] = tmp / f"{kind}-{repeat}"
            cfg = RunConfig.of(**base, **extra, run_dir=str(dirs[kind]))
            started = time.perf_counter()
            run(cfg)
            walls[kind].append(time.perf_counter() - started)
        same = same and snapshot(dirs["ray"]) == snapshot(dirs["local"])
        calls = env_calls(dirs["local"])

    compare("env call, echo env (transport only)", echo, args.repeats, args.calls)
    compare("env call, ALFWorld look", trips, args.repeats, args.calls)
    local_wall, ray_wall = (statistics.median(walls[k]) for k in ("local", "ray"))
    print(
        f"run of {args.games} valid_seen games (scripted:expert, {args.workers} workers, "
        f"{args.concurrency} in flight, {calls} env calls), median of {args.repeats}: local "
        f"{local_wall:.1f}s, Ray {ray_wall:.1f}s, ratio {ray_wall / local_wall:.2f}x; Ray "
        f"overhead {(ray_wall - local_wall) / calls * 1e3:+.2f} ms of wall time per env call"
    )
    print(f"same episodes, steps and reflections: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
