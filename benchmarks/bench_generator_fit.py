"""Generated ALFWorld games beside ALFWorld's train split (and the 140 valid_seen games).

Generates ``--per-type`` games of each task type, then prints, for the generated games, the train
split's statistics (``envs/alfgen/train_stats.json``) and, when present, the real valid_seen
games (``$ALFWORLD_DATA`` or the shared copy; printed for comparison only, never fitted to):
rooms per task type, receptacles per room, target copies, the share of targets behind a closed
door and in a goal-type receptacle, walkthrough lengths, and the share of (type, object,
receptacle) combinations that occur in the train split. Each figure's total-variation distance to
the train split follows (a share's distance is the difference of the shares); the script exits 1
when a generated figure is more than ``--max-tv`` away or a combination is not the train split's.
Also prints the CPU seconds each game took (the machine may be shared: compare runs side by side).

    python benchmarks/bench_generator_fit.py --per-type 30 --workers 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs.alfgen.stats import (  # noqa: E402
    distances,
    format_report,
    read_games,
    summarize,
    train_reference,  # noqa: E402
)
from envs.discovery import SPLITS, normalize_task_types  # noqa: E402

SHARED_DATA = ROOT.parent / "shared" / "alfworld_data"
REAL_SPLIT = "eval_in_distribution"


def make_type(task_type: str, root: str, per_type: int, seed: int, split: str) -> list[float]:
    """Generate one task type's games into ``root``; CPU seconds per game."""
    from envs.alfgen.generator import GameMaker, write_game

    cpu: list[float] = []
    with GameMaker(split) as maker:
        maker.planner()  # imports and the grammar parse once per process, not per game
        for index in range(per_type):
            c0 = time.process_time()
            write_game(Path(root), maker.make(task_type, seed, index))
            cpu.append(time.process_time() - c0)
    return cpu


def real_games() -> Path | None:
    value = os.environ.get("ALFWORLD_DATA")
    for root in ([Path(value)] if value else []) + [SHARED_DATA]:
        if (root / SPLITS[REAL_SPLIT]).is_dir():
            return root / SPLITS[REAL_SPLIT]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-type", type=int, default=30)
    ap.add_argument("--workers", type=int, default=1, help="processes (one task type each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="train")
    ap.add_argument("--task-types", nargs="+", default=None, help="subset, e.g. put clean")
    ap.add_argument("--out", default=None, help="keep the games here (default: a temp dir)")
    ap.add_argument("--max-tv", type=float, default=0.1)
    args = ap.parse_args()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_alfgen_fit_"))
    types = normalize_task_types(args.task_types)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        jobs = [
            pool.submit(make_type, t, str(out), args.per_type, args.seed, args.split) for t in types
        ]
        cpu = [s for j in jobs for s in j.result()]
    wall = time.perf_counter() - t0

    generated = summarize(read_games(out))
    train = train_reference()
    columns = {"generated": generated, "train split": train}
    real = real_games()
    if real is not None:
        columns["valid_seen"] = summarize(read_games(real))
    print(
        f"{generated.games} games ({args.per_type} per type, seed {args.seed}, split {args.split})"
    )
    print(f"under {out}; valid_seen: {real or 'not present'}")
    print(format_report(columns, reference="train split"))

    dist = distances(generated, train)
    worst = sorted(dist.items(), key=lambda kv: -kv[1])
    print()
    print("total-variation distance to the train split, generated games, largest first:")
    for key, value in worst:
        print(f"  {key:24} {value:.3f}{'  > ' + str(args.max_tv) if value > args.max_tv else ''}")
    ok = worst[0][1] <= args.max_tv and generated.combos_in_train == 1.0
    print(
        f"max distance {worst[0][1]:.3f} (goal <= {args.max_tv}); combinations in the train split "
        f"{100 * generated.combos_in_train:.1f}% (goal 100%)"
    )
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"CPU seconds per game: median {statistics.median(cpu):.2f}, max {max(cpu):.2f}; "
        f"wall {wall:.0f}s with {args.workers} worker(s); load average {load}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
