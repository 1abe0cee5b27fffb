"""Generated ALFWorld games: generation time, walkthrough wins, and how often a random agent wins.

For each task type: generate ``--per-type`` games (seconds per game, median and max, and how many
draws a game took), replay every stored walkthrough through ``ALFWorldEnv`` on the written files
(must win 100%), then let a random-admissible-action agent play each game for ``--steps`` steps.
With real ALFWorld games present (``$ALFWORLD_DATA`` or the shared copy), the same random agent
plays ``--real`` of them per type in the same run, so the two win rates sit side by side.

    python benchmarks/bench_generator.py --per-type 30 --workers 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs.discovery import SPLITS, normalize_task_types  # noqa: E402

SHARED_DATA = ROOT.parent / "shared" / "alfworld_data"
REAL_SPLIT = "eval_in_distribution"


def random_episode(env: Any, game_id: str, steps: int, seed: str) -> tuple[bool, int]:
    """Uniformly random admissible commands for ``steps`` steps: (won, steps taken)."""
    rng = random.Random(seed)
    _, info = env.reset(options={"game": game_id})
    for step in range(1, steps + 1):
        _, _, _, _, info = env.step(rng.choice(info["admissible_commands"]))
        if info["won"]:
            return True, step
    return False, steps


def walkthrough_wins(env: Any, game_id: str, walkthrough: list[str]) -> bool:
    env.reset(options={"game": game_id})
    for command in walkthrough:
        _, _, _, _, info = env.step(command)
    return bool(info["won"])


def bench_type(
    task_type: str, root: str, per_type: int, seed: int, steps: int, split: str
) -> dict[str, Any]:
    from envs.alfgen.generator import GameMaker, write_game
    from envs.alfworld_env import ALFWorldEnv, game_walkthrough

    gen_s, gen_cpu, attempts, lengths, ids = [], [], [], [], []
    with GameMaker(split) as maker:
        # Imports and the planner's grammar parse are paid once per process, not per game.
        import textworld  # noqa: F401

        maker.planner()
        for index in range(per_type):
            t0, c0 = time.perf_counter(), time.process_time()
            files = maker.make(task_type, seed, index)
            write_game(Path(root), files)
            gen_s.append(time.perf_counter() - t0)
            gen_cpu.append(time.process_time() - c0)
            attempts.append(files.attempt + 1)
            lengths.append(len(files.walkthrough))
            ids.append(files.game_id)
    env = ALFWorldEnv(data_dir=root, split=split, games=ids, max_steps=max(steps, 100))
    # the stored walkthroughs, read from the written files (the env's replies never carry them)
    stored = [game_walkthrough(Path(root) / g / "game.tw-pddl") or [] for g in ids]
    walk = [walkthrough_wins(env, g, w) for g, w in zip(ids, stored, strict=True)]
    rand = [random_episode(env, g, steps, f"{seed}:{g}") for g in ids]
    env.close()
    return {
        "task_type": task_type,
        "gen_s": gen_s,
        "gen_cpu": gen_cpu,
        "attempts": attempts,
        "lengths": lengths,
        "walk": walk,
        "random": [won for won, _ in rand],
    }


def bench_real(task_type: str, data: str, count: int, steps: int, seed: int) -> dict[str, Any]:
    from envs.alfworld_env import ALFWorldEnv, game_walkthrough

    env = ALFWorldEnv(
        data_dir=data, split=REAL_SPLIT, task_types=[task_type], max_steps=max(steps, 100)
    )
    ids = env.game_ids
    picked = [
        ids[round(i * (len(ids) - 1) / max(count - 1, 1))] for i in range(min(count, len(ids)))
    ]
    lengths, rand = [], []
    for g in picked:
        won, _ = random_episode(env, g, steps, f"{seed}:{g}")
        rand.append(won)
        lengths.append(len(game_walkthrough(Path(data) / g / "game.tw-pddl") or []))
    env.close()
    return {"task_type": task_type, "random": rand, "lengths": lengths}


def real_data() -> Path | None:
    value = os.environ.get("ALFWORLD_DATA")
    for root in ([Path(value)] if value else []) + [SHARED_DATA]:
        if (root / SPLITS[REAL_SPLIT]).is_dir():
            return root
    return None


def pct(flags: list[bool]) -> str:
    return (
        f"{100.0 * sum(flags) / len(flags):5.1f}% ({sum(flags)}/{len(flags)})" if flags else "    -"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-type", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=50, help="random agent's step budget")
    ap.add_argument(
        "--workers", type=int, default=1, help="processes (one task type each at a time)"
    )
    ap.add_argument(
        "--real", type=int, default=3, help="real games per type for the random agent (0: none)"
    )
    ap.add_argument("--split", default="train")
    ap.add_argument("--task-types", nargs="+", default=None, help="subset, e.g. put clean")
    ap.add_argument("--out", default=None, help="keep the games here (default: a temp dir)")
    args = ap.parse_args()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_alfgen_"))
    data = real_data() if args.real > 0 else None
    types = normalize_task_types(args.task_types)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        gen_jobs = [
            pool.submit(bench_type, t, str(out), args.per_type, args.seed, args.steps, args.split)
            for t in types
        ]
        real_jobs = (
            [pool.submit(bench_real, t, str(data), args.real, args.steps, args.seed) for t in types]
            if data
            else []
        )
        results = [j.result() for j in gen_jobs]
        reals = {r["task_type"]: r for r in (j.result() for j in real_jobs)}
    wall = time.perf_counter() - t0

    print(
        f"generated {args.per_type} games per type (seed {args.seed}, split {args.split}) under {out}"
    )
    print(
        f"random agent: uniform over admissible commands, {args.steps} steps, one episode per game"
    )
    if data:
        print(
            f"real games: {args.real} per type from {data / SPLITS[REAL_SPLIT]}, evenly spaced by id"
        )
    print(
        f"{'task type':31} {'games':>5} {'gen wall s med/max':>18} {'gen cpu s med/max':>17}"
        f" {'draws':>5} {'walkthrough won':>16} {'random won (gen)':>17} {'random won (real)':>17}"
        f" {'walk len min/med/max':>20} {'(real med)':>10}"
    )
    all_walk: list[bool] = []
    all_rand: list[bool] = []
    all_real: list[bool] = []
    all_gen: list[float] = []
    all_cpu: list[float] = []
    med = statistics.median
    for r in results:
        real = reals.get(r["task_type"], {"random": [], "lengths": []})
        lengths = r["lengths"]
        all_walk += r["walk"]
        all_rand += r["random"]
        all_real += real["random"]
        all_gen += r["gen_s"]
        all_cpu += r["gen_cpu"]
        real_len = f"{med(real['lengths']):.0f}" if real["lengths"] else "-"
        walk_len = f"{min(lengths)}/{med(lengths):.0f}/{max(lengths)}"
        print(
            f"{r['task_type']:31} {len(lengths):5d} {med(r['gen_s']):10.2f}/{max(r['gen_s']):<7.2f}"
            f" {med(r['gen_cpu']):9.2f}/{max(r['gen_cpu']):<7.2f} {statistics.mean(r['attempts']):5.2f}"
            f" {pct(r['walk']):>16} {pct(r['random']):>17} {pct(real['random']):>17}"
            f" {walk_len:>20} {real_len:>10}"
        )
    print(
        f"{'overall':31} {len(all_walk):5d} {med(all_gen):10.2f}/{max(all_gen):<7.2f}"
        f" {med(all_cpu):9.2f}/{max(all_cpu):<7.2f} {'':5}"
        f" {pct(all_walk):>16} {pct(all_rand):>17} {pct(all_real):>17}"
    )
    rate = sum(all_rand) / len(all_rand)
    print(f"walkthrough win rate {100.0 * sum(all_walk) / len(all_walk):.1f}% (must be 100%)")
    print(f"random-agent win rate on generated games {100.0 * rate:.1f}% (must be under 20%)")
    if all_real:
        real_rate = sum(all_real) / len(all_real)
        print(
            f"random-agent win rate on real games {100.0 * real_rate:.1f}% (same agent, same run)"
        )
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"wall time {wall:.0f}s with {args.workers} worker(s); load average at the end {load}")
    return 0 if all(all_walk) and rate < 0.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
