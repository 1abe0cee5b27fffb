"""Runner benchmark: the full runner with 2 env workers vs one env playing the same episodes.

Prints, in one run, as medians of repeats measured side by side:
  (a) wall time of ``run_alfworld.py --model scripted:expert --workers 2`` over the games
      (valid_seen: 140) vs one ALFWorldEnv playing the same walkthroughs sequentially (goal:
      >= 1.8x on 2 free cores), beside the speed-up of the worker pool alone (EnvPool with 2
      workers, no runner) on the same games (goal: the runner keeps >= 85% of it);
  (b) the runner's overhead per step over the bare env: the runner with one worker and one
      episode in flight vs the bare env, per env step.

    python benchmarks/bench_runner.py [--data DIR] [--games N] [--repeats R]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_envs import play_pool, play_sequential, walkthroughs
from timing import data_parser

from envs.alfworld_env import ALFWorldEnv
from envs.discovery import discover_games
from envs.pool import EnvPool, EnvSpec, Reset
from experiments.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
SPLIT = "eval_in_distribution"


def runner(data: Path, n: int, workers: int, concurrency: int) -> tuple[float, float, int]:
    """(wall seconds of the whole command, seconds the run itself took, env steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "run_alfworld.py"), "--model", "scripted:expert",
               "--data", str(data), "--split", SPLIT, "--games", str(n), "--trials", "1",
               "--workers", str(workers), "--concurrency", str(concurrency), "--run-dir", str(run_dir)]  # fmt: skip
        began = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        wall = time.perf_counter() - began
        store = RunStore(run_dir, readonly=True)
        inner = float(store.get_meta("wall_s", 0.0))
        steps = store.conn.execute("SELECT COUNT(*) FROM steps WHERE kind='act'").fetchone()[0]
        won = sum(e.won for e in store.episodes())
        store.close()
        assert won == n, f"the expert won {won}/{n}"
        return wall, inner, steps


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--games", type=int, default=140)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    records = discover_games(Path(args.data), SPLIT)[: args.games]
    games = [r.game_id for r in records]
    plans = walkthroughs([(r.game_id, r.path) for r in records])  # read before any timing
    n = len(games)
    spec = EnvSpec("alfworld", {"data_dir": args.data, "split": SPLIT})
    env = ALFWorldEnv(**spec.kwargs)
    seq, pooled, par, one = [], [], [], []
    with EnvPool(spec, workers=2, timeout_s=300) as pool:
        # warm up: each side imports TextWorld once; not part of any timing (the runner's
        # "in the run" time starts once its workers are up)
        pool.reset_many({slot: Reset(games[-1 - slot]) for slot in range(2)})
        env.reset(options={"game": games[-1]})
        for r in range(args.repeats):
            seq.append(play_sequential(env, plans))
            pooled.append(play_pool(pool, plans))
            par.append(runner(args.data, n, workers=2, concurrency=4))
            one.append(runner(args.data, n, workers=1, concurrency=1))
            print(
                f"repeat {r}: one env {seq[-1]:.1f}s, pool w2 {pooled[-1]:.1f}s, "
                f"runner w2 {par[-1][1]:.1f}s in the run ({par[-1][0]:.1f}s whole command), "
                f"runner w1 {one[-1][1]:.1f}s in the run",
                flush=True,
            )
    env.close()
    steps = par[-1][2]
    med = statistics.median
    s, p = med(seq), med(pooled)
    p_wall, p_inner = med(x[0] for x in par), med(x[1] for x in par)
    o_inner = med(x[1] for x in one)
    pool_x, run_x = s / p, s / p_inner
    print(
        f"\n{n} games, {steps} env steps, {args.repeats} repeats, load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    print(f"(a) one env sequential: {s:.1f}s; EnvPool(2 workers) alone: {p:.1f}s ({pool_x:.2f}x)")
    print(
        f"    runner --workers 2: {p_inner:.1f}s in the run, {p_wall:.1f}s whole command (process "
        f"start, worker start, report)"
    )
    print(
        f"    speed-up: {run_x:.2f}x in the run (goal >= 1.8x), {s / p_wall:.2f}x whole command; "
        f"{run_x / pool_x * 100:.0f}% of the pool's own speed-up (goal >= 85%)"
    )
    print(
        f"(b) runner --workers 1 --concurrency 1: {o_inner:.1f}s in the run; overhead per env step "
        f"{(o_inner - s) / steps * 1000:.1f} ms ({(o_inner / s - 1) * 100:.1f}% over the bare env)"
    )


if __name__ == "__main__":
    main()
