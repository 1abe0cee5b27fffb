"""Fast ALFWorld steps and cheap resets: ALFWorldEnv's fast path against TextWorld's.

Prints, as medians of repeats measured side by side in one run (the env order rotates every
repeat, so all sides see the same machine at nearly the same time):
  (a) per-step time over seeded random admissible walks on valid_seen and generated games:
      ALFWorldEnv (fast text, the default) vs ALFWorldEnv(fast_text=False) (TextWorld's own
      grammar) vs a raw TextWorld PddlEnv in alfworld's AlfredDemangler (goal: >= 5x faster than
      raw; stretch: <= 10 ms a step);
  (b) reset time: a game's first reset (load + translation) vs a reset of a game the env has seen
      (the same game again, and back to it after another game), with the reset cache on and off
      (goal: a seen game's reset >= 5x faster than its first);
  (c) RSS of one default env, alone in a worker process, after 10, 70, 140 games (flat);
  (p) with --only p: cProfile of 5 games x 40 random steps, TextWorld's path then the fast path.

    python benchmarks/bench_fast_step.py [--data DIR] [--games N] [--steps S] [--repeats R]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_envs import bench_rss, load, raw_engine  # noqa: E402
from envs.alfworld_env import DEFAULT_RESET_CACHE, ALFWorldEnv  # noqa: E402
from envs.discovery import discover_games  # noqa: E402

REAL_SPLIT = "eval_in_distribution"
GENERATED_SPLIT = "eval_out_of_distribution"
Game = tuple[Path, str, str, Path]  # data dir, split, game id, game file


def evenly(items: list[Any], n: int) -> list[Any]:
    return items[:: max(1, len(items) // max(1, n))][:n]


def pick_games(data: Path, split: str, n: int) -> list[Game]:
    """``n`` games spread over the task types (ids are sorted by task folder)."""
    records = discover_games(data, split)
    return [(data, split, r.game_id, r.path) for r in evenly(records, n)]


def generated_games(where: Path | None, n: int) -> list[Game]:
    """``n`` generated games: from ``where`` if it has them, else freshly generated there."""
    from envs.alfgen import generate

    root = where or Path(tempfile.mkdtemp(prefix="bench_fast_step_"))
    try:
        games = pick_games(root, GENERATED_SPLIT, n)
    except Exception:
        games = []
    if len(games) < n:
        began = time.perf_counter()
        generate(root, per_type=-(-n // 6), seed=2024, split=GENERATED_SPLIT)
        print(f"generated games under {root} in {time.perf_counter() - began:.0f} s")
        games = pick_games(root, GENERATED_SPLIT, n)
    return games


def plan_walk(side: EnvSide, game: Game, steps: int, seed: int) -> list[str]:
    """A seeded random admissible walk (a win ends it early), planned on ``side``'s env."""
    rng = random.Random(seed)
    info = side.reset(game)
    actions = []
    for _ in range(steps):
        actions.append(rng.choice(info["admissible_commands"]))
        _, _, won, _, info = side.step(actions[-1])
        if won:
            break
    return actions


# -- (a) -------------------------------------------------------------------------------------------
class Side:
    """One way to play a game: reset untimed, steps timed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.step_s: list[float] = []  # per repeat, summed over games
        self.steps: list[int] = []
        self._loaded: str | None = None

    def reset(self, game: Game) -> Any:
        raise NotImplementedError

    def step(self, action: str) -> Any:
        raise NotImplementedError

    def play(self, game: Game, actions: list[str], rep: int) -> None:
        self.reset(game)
        while len(self.step_s) <= rep:
            self.step_s.append(0.0)
            self.steps.append(0)
        began = time.perf_counter()
        for action in actions:
            self.step(action)
        self.step_s[rep] += time.perf_counter() - began
        self.steps[rep] += len(actions)

    def ms_per_step(self) -> list[float]:
        return [1000 * s / n for s, n in zip(self.step_s, self.steps, strict=True)]


class EnvSide(Side):
    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name)
        self.kwargs = kwargs
        self.envs: dict[tuple[Path, str], ALFWorldEnv] = {}

    def reset(self, game: Game) -> dict[str, Any]:
        data, split, game_id, _ = game
        if (data, split) not in self.envs:
            self.envs[data, split] = ALFWorldEnv(data, split, max_steps=10**6, **self.kwargs)
        self.env = self.envs[data, split]
        return self.env.reset(options={"game": game_id})[1]

    def step(self, action: str) -> Any:
        return self.env.step(action)


class RawSide(Side):
    """PddlEnv + AlfredDemangler, as alfworld builds it (loads each game once)."""

    def __init__(self) -> None:
        super().__init__("raw PddlEnv")
        self.raw = raw_engine()

    def reset(self, game: Game) -> None:
        if self._loaded != game[2]:
            self.raw.load(str(game[3]))
            self._loaded = game[2]
        self.raw.reset()

    def step(self, action: str) -> Any:
        return self.raw.step(action)


def bench_steps(kinds: dict[str, list[Game]], steps: int, repeats: int) -> None:
    """Per game, each repeat plays the same walk on every side, in a rotated order."""
    med = statistics.median
    for kind, games in kinds.items():
        fast = EnvSide("fast", reset_cache=len(games))
        textworld = EnvSide("TextWorld's grammar", fast_text=False, reset_cache=len(games))
        raw = RawSide()
        sides: list[Side] = [fast, textworld, raw]
        total = 0
        for n, game in enumerate(games):
            actions = plan_walk(fast, game, steps, seed=n)
            total += len(actions)
            for rep in range(repeats):
                for i in range(len(sides)):
                    sides[(rep + i) % len(sides)].play(game, actions, rep)
        f, t, r = fast.ms_per_step(), textworld.ms_per_step(), raw.ms_per_step()
        raw_ratio = [b / a for a, b in zip(f, r, strict=True)]
        tw_ratio = [b / a for a, b in zip(f, t, strict=True)]
        print(
            f"(a) {kind}: {len(games)} games, {total} steps a repeat: ms/step fast "
            f"{med(f):.2f}, TextWorld's grammar {med(t):.1f}, raw PddlEnv {med(r):.1f}; "
            f"fast is {med(raw_ratio):.1f}x raw (goal >= 5x), {med(tw_ratio):.1f}x TextWorld's "
            f"grammar; raw/fast ratios {', '.join(f'{x:.1f}' for x in raw_ratio)}"
        )


# -- (b) -------------------------------------------------------------------------------------------
def timed_reset(env: ALFWorldEnv, game_id: str) -> float:
    began = time.perf_counter()
    env.reset(options={"game": game_id})
    return time.perf_counter() - began


def bench_resets(games: list[Game], repeats: int) -> None:
    """For each game, on envs that have not seen it: first reset, then resets of the seen game
    (the same game again; back to it after another game), cache on and off."""
    med = statistics.median
    rows: dict[str, list[float]] = {}
    first_again: list[float] = []
    first_back: list[float] = []
    for n, game in enumerate(games):
        data, split, game_id, _ = game
        other = games[n - 1][2] if games[n - 1][:2] == game[:2] else None
        for label, cache in (("on", DEFAULT_RESET_CACHE), ("off", 0)):
            env = ALFWorldEnv(data, split, reset_cache=cache)
            first = timed_reset(env, game_id)
            again = med(timed_reset(env, game_id) for _ in range(repeats))
            rows.setdefault(f"first {label}", []).append(first)
            rows.setdefault(f"again {label}", []).append(again)
            if cache:
                first_again.append(first / again)
            if other is not None:
                back = []
                for _ in range(repeats):
                    env.reset(options={"game": other})
                    back.append(timed_reset(env, game_id))
                rows.setdefault(f"back {label}", []).append(med(back))
                if cache:
                    first_back.append(first / med(back))
    ms = {k: 1000 * med(v) for k, v in rows.items()}
    print(
        f"(b) resets over {len(games)} games (medians): first {ms['first on']:.0f} ms; same game "
        f"again {ms['again on']:.1f} ms (cache off: {ms['again off']:.0f} ms); back to it after "
        f"another game {ms['back on']:.1f} ms (cache off: {ms['back off']:.0f} ms). A seen game's "
        f"reset is {med(first_again):.0f}x faster than its first (goal >= 5x; per game min "
        f"{min(first_again):.0f}x); back to it after another game {med(first_back):.0f}x"
    )


# -- (p) -------------------------------------------------------------------------------------------
def bench_profile(games: list[Game], steps: int) -> None:
    planner = EnvSide("planner")
    walks = [(game, plan_walk(planner, game, steps, seed=n)) for n, game in enumerate(games)]
    for label, fast_text in (("TextWorld's grammar", False), ("fast path", True)):
        side = EnvSide(label, fast_text=fast_text, reset_cache=0)
        profile = cProfile.Profile()
        for game, actions in walks:
            side.reset(game)
            profile.enable()
            for action in actions:
                side.step(action)
            profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(14)
        print(f"(p) profile of env.step, {label}:\n{out.getvalue()}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--data", default=os.environ.get("ALFWORLD_DATA", str(ROOT.parent / "shared/alfworld_data"))
    )
    parser.add_argument("--generated", default=None, help="dir of generated games (made if empty)")
    parser.add_argument("--games", type=int, default=20, help="games of each kind for (a)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each walk in (a)")
    parser.add_argument("--reset-games", type=int, default=10, help="games of each kind for (b)")
    parser.add_argument("--rss-games", type=int, default=140, help="valid_seen games for (c)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="abc", help="which parts to run, e.g. 'ab' or 'p'")
    args = parser.parse_args()
    data = Path(args.data)
    print(f"{load()}; a shared machine: compare the ratios, not the times")
    need = max(args.games if "a" in args.only else 0, args.reset_games if "b" in args.only else 0)
    real = pick_games(data, REAL_SPLIT, max(need, 5))
    made = generated_games(Path(args.generated) if args.generated else None, need) if need else []
    if "a" in args.only:
        kinds = {"valid_seen": real[: args.games], "generated": made[: args.games]}
        bench_steps(kinds, args.steps, args.repeats)
    if "b" in args.only:
        bench_resets(real[: args.reset_games] + made[: args.reset_games], args.repeats)
    if "c" in args.only:
        ids = [g[2] for g in pick_games(data, REAL_SPLIT, args.rss_games)]
        marks = tuple(m for m in (10, 70, 140) if m < len(ids)) + (len(ids),)
        bench_rss(data, ids, marks)
    if "p" in args.only:
        bench_profile(real[:5], 40)
    print(f"done; {load()}")


if __name__ == "__main__":
    main()
