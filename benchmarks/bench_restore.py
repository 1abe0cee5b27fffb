"""What restoring a search node costs, measured side by side in one run (medians of repeats).

A tree search restores a node with ``reset(replay=actions)``: a reset plus one env step per
action of the node's path. This prints, for one generated ALFWorld game in this process, the
median time of one step, of a bare reset, and of restoring a node at depth 2, 4 and the end of
the walkthrough, each as a ratio to one step. LATS executes a child only when it selects it
(one restore per iteration, not one per candidate) because of these ratios.

Run: ``python benchmarks/bench_restore.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402

from envs.alfgen import generate  # noqa: E402
from envs.alfworld_env import ALFWorldEnv, game_walkthrough  # noqa: E402

SPLIT = "eval_out_of_distribution"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), per_type=1, seed=7, split=SPLIT)
        env = ALFWorldEnv(tmp, SPLIT, max_steps=50)
        game = next(g for g in env.game_ids if "pick_two_obj" in g)
        _, info = env.reset(options={"game": game})
        walkthrough = game_walkthrough(Path(info["game_file"])) or []

        def restore(depth: int) -> None:
            env.reset(options={"game": game})
            for action in walkthrough[:depth]:
                env.step(action)

        def one_step() -> None:
            env.step("look")

        env.reset(options={"game": game})
        step = median_time(one_step, args.repeats * 4)
        reset = median_time(lambda: restore(0), args.repeats)
        rows = [("one step", step), ("reset (depth 0)", reset)]
        for depth in sorted({2, 4, len(walkthrough)}):
            rows.append((f"restore at depth {depth}", median_time(lambda d=depth: restore(d),
                                                                   args.repeats)))  # fmt: skip
        env.close()
    print(f"game {game} (walkthrough of {len(walkthrough)} actions), {args.repeats} repeats")
    for name, seconds in rows:
        print(f"  {name:<24} {seconds / step:8.1f} x one step")


if __name__ == "__main__":
    main()
