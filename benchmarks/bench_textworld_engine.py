"""TextWorld engine reuse: RSS and time per game switch over 30 resets, three ways.

Each way runs alone in a fresh interpreter, cycling through the same 3 generated games (every
reset switches game and plays one step); the rounds are interleaved and the medians printed:
  tw-load   one TextWorld engine, ``env.load(next_game)`` (TextWorld's own reuse);
  env       ``TextWorldEnv`` (one engine; shuts the interpreter down before ``load``);
  fresh     a new ``textworld.start(game)`` per reset, the old one closed.

    python benchmarks/bench_textworld_engine.py [--games DIR] [--resets 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("tw-load", "env", "fresh")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(mode: str, games: list[str], resets: int) -> dict[str, float]:
    import textworld

    from envs.textworld_env import TextWorldEnv

    infos = textworld.EnvInfos(
        feedback=True, admissible_commands=True, won=True, lost=True, score=True, max_score=True
    )
    start = _rss_mib()
    samples: list[float] = []
    t0 = time.perf_counter()
    if mode == "env":
        env = TextWorldEnv(game_dir=str(Path(games[0]).parent))
        ids = env.game_ids
        for i in range(resets):
            env.reset(options={"game": ids[i % len(ids)]})
            env.step("look")
            samples.append(_rss_mib())
    else:
        tw = None
        for i in range(resets):
            game = games[i % len(games)]
            if mode == "fresh" or tw is None:
                if tw is not None:
                    tw.close()
                tw = textworld.start(game, infos)
            else:
                tw.load(game)
            tw.reset()
            tw.step("look")
            samples.append(_rss_mib())
    elapsed = time.perf_counter() - t0
    return {
        "ms_per_reset": 1000 * elapsed / resets,
        "rss_after_first": samples[0] - start,
        "growth": samples[-1] - samples[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=Path, default=None, help="folder with >= 3 .z8 games")
    parser.add_argument("--resets", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "GAMES_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], json.loads(args.child[1]), args.resets)))
        return

    with tempfile.TemporaryDirectory(prefix="bench-tw-") as tmp:
        folder = args.games
        if folder is None:
            from envs.twgen import generate_textworld_games

            folder = Path(tmp)
            t0 = time.perf_counter()
            generate_textworld_games(folder, 3, seed=0, challenge="tw-cooking")
            print(f"generated 3 tw-cooking games in {time.perf_counter() - t0:.1f} s")
        games = sorted(str(p) for p in folder.glob("*.z8"))[:3]
        if len(games) < 3:
            raise SystemExit(f"need 3 .z8 games in {folder}")
        results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                out = subprocess.run(
                    [sys.executable, __file__, "--resets", str(args.resets), "--child", mode,
                     json.dumps(games)],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))

    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(
        f"{args.resets} resets over 3 games, medians of {args.repeats} (load {os.getloadavg()[0]:.1f})"
    )
    print(f"{'mode':8} {'ms/reset':>9} {'RSS first (MiB)':>16} {'RSS growth 1->N (MiB)':>22}")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:8} {m['ms_per_reset']:9.1f} {m['rss_after_first']:16.1f} {m['growth']:22.1f}")
    env, load, fresh = med["env"], med["tw-load"], med["fresh"]
    print(f"time ratio env/fresh = {env['ms_per_reset'] / fresh['ms_per_reset']:.2f}, "
          f"env/tw-load = {env['ms_per_reset'] / load['ms_per_reset']:.2f}")  # fmt: skip
    print(f"RSS growth: tw-load {load['growth']:.1f} MiB vs env {env['growth']:.1f} MiB "
          f"vs fresh {fresh['growth']:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
