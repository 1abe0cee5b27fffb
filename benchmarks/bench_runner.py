"""Runner benchmark: the full runner with 2 env workers vs one env playing the same episodes.

Prints, in one run, as medians of repeats measured side by side:
  (a) wall time of ``run_alfworld.py --model scripted:expert --workers 2`` over the games
      (valid_seen: 140) vs one ALFWorldEnv playing the same walkthroughs sequentially (goal:
      >= 1.8x on 2 free cores);
  (b) the runner's overhead per step over the bare env: the runner with one worker and one
      episode in flight vs the bare env, per env step.

    python benchmarks/bench_runner.py [--data DIR] [--games N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from envs.alfworld_env import ALFWorldEnv
from experiments.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
SPLIT = "eval_in_distribution"


def sequential(data: Path, games: list[str]) -> tuple[float, int]:
    """One env, walkthroughs played one game after another: (seconds, env steps)."""
    began = time.perf_counter()
    env = ALFWorldEnv(data_dir=data, split=SPLIT, games=games)
    steps = 0
    for game in games:
        _, info = env.reset(options={"game": game})
        for action in info["walkthrough"]:
            env.step(action)
            steps += 1
    env.close()
    return time.perf_counter() - began, steps


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(os.environ.get("ALFWORLD_DATA", ROOT.parent / "shared" / "alfworld_data")),
    )
    parser.add_argument("--games", type=int, default=140)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = ALFWorldEnv(data_dir=args.data, split=SPLIT)
    games = env.game_ids[: args.games]
    env.close()
    n = len(games)
    seq, par, one = [], [], []
    steps = 0
    for r in range(args.repeats):
        s, steps = sequential(args.data, games)
        seq.append(s)
        par.append(runner(args.data, n, workers=2, concurrency=4))
        one.append(runner(args.data, n, workers=1, concurrency=1))
        print(
            f"repeat {r}: sequential {s:.1f}s, runner w2 {par[-1][0]:.1f}s, runner w1 {one[-1][0]:.1f}s",
            flush=True,
        )
    s = statistics.median(seq)
    p_wall = statistics.median(x[0] for x in par)
    p_inner = statistics.median(x[1] for x in par)
    o_inner = statistics.median(x[1] for x in one)
    print(
        f"\n{n} games, {steps} env steps, {args.repeats} repeats, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    print(
        f"(a) one env sequential: {s:.1f}s; runner --workers 2: {p_wall:.1f}s whole command ({p_inner:.1f}s in the run)"
    )
    print(
        f"    speed-up: {s / p_wall:.2f}x whole command, {s / p_inner:.2f}x run only (goal >= 1.8x)"
    )
    print(
        f"(b) runner --workers 1 --concurrency 1: {o_inner:.1f}s in the run; overhead per env step "
        f"{(o_inner - s) / steps * 1000:.1f} ms ({(o_inner / s - 1) * 100:.1f}% over the bare env)"
    )


if __name__ == "__main__":
    main()
