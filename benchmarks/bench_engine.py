"""Engine benchmark: a slow model server and real envs, against the bound the run cannot beat.

A real loopback OpenAI-compatible server (``tests/support/fault_server.py``) answers each ALFWorld prompt
with the game's next walkthrough move after a random delay (lognormal, median 0.3 s, sigma 0.8:
a long tail), seeded by the prompt so every repeat sees the same delays. The runner plays the
first 12 valid_seen games (``--concurrency 8 --workers 2``, one trial). Printed, as medians of
repeats measured side by side in one run:

- env-bound wall time: the same run with an instant server;
- the bound: max(env-bound wall time, total served latency / concurrency);
- the run's wall time and its ratio to the bound (goal: <= 1.15);
- what the tick rule (every tick waits for the slowest request of the live episodes) would
  have cost on the same recorded latencies, model time alone;
- the longest episode's own answer latencies in a row: a chain no schedule can shorten, which
  the bound above leaves out (with the fast ALFWorld step, 12 games' env time is a few seconds,
  so this chain and the workers' start are a large share of any run);
- a tighter bound: env-bound wall time plus the shortest episode's own answers. Resets are
  nearly all of the env time (a first reset loads the game: most of a second; a step takes
  milliseconds), so the last reset cannot end much before the env-bound wall time, and the
  game reset last must still wait for its own answers after it.

    python benchmarks/bench_engine.py [--data DIR] [--games 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test servers: tests/support

from envs.alfworld_env import ALFWorldEnv, game_walkthrough  # noqa: E402
from experiments.config import RunConfig  # noqa: E402
from experiments.session import run  # noqa: E402
from experiments.store import open_reader  # noqa: E402
from tests.support.fault_server import FaultPlan, FaultServer  # noqa: E402

SPLIT = "eval_in_distribution"
MEDIAN_S, SIGMA = 0.3, 0.8


def lognormal_delay(prompt: str) -> float:
    """A seeded lognormal draw: the same prompt always waits the same."""
    h = hashlib.sha256(prompt.encode()).digest()
    u1 = (int.from_bytes(h[:8], "big") + 1) / (2**64 + 2)
    u2 = (int.from_bytes(h[8:16], "big") + 1) / (2**64 + 2)
    z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
    return MEDIAN_S * math.exp(SIGMA * z)


class WalkthroughServer:
    """Answers an actor prompt with the next walkthrough move of the game it is about."""

    def __init__(self, data: Path, games: list[str]) -> None:
        env = ALFWorldEnv(data_dir=data, split=SPLIT, games=games)
        self.games: list[tuple[str, list[str]]] = []
        for game in games:
            obs, info = env.reset(options={"game": game})
            # read from the game file: the env's replies never carry the walkthrough
            self.games.append((obs, game_walkthrough(Path(info["game_file"])) or []))
        env.close()

    def answer(self, prompt: str) -> str:
        for first, walkthrough in self.games:
            at = prompt.rfind(first)
            if at >= 0:
                done = prompt[at:].count("\n> ")
                return " " + (walkthrough[done] if done < len(walkthrough) else "look")
        return " look"


def play(url: str, data: Path, n: int, concurrency: int, workers: int) -> tuple[float, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    cfg = RunConfig.of(
        model="openai:bench", base_url=url, data=str(data), split=SPLIT, games=n, trials=1,
        max_steps=40, workers=workers, concurrency=concurrency, run_dir=str(tmp / "run"),
        backend_options={"concurrency": concurrency, "max_retries": 0, "timeout": 60},
    )  # fmt: skip
    began = time.perf_counter()
    run_dir = run(cfg)
    return time.perf_counter() - began, run_dir


def latencies(run_dir: Path) -> dict[str, list[float]]:
    """Each episode's model-call latencies, in order."""
    with open_reader(run_dir) as reader:
        out: dict[str, list[float]] = {}
        for call in reader.model_calls():
            if call.episode_id is not None:
                out.setdefault(call.episode_id, []).append(call.latency_s)
        assert all(e.won for e in reader.episodes()), "every walkthrough must win"
    return out


def tick_rule(episodes: list[list[float]], slots: int) -> float:
    """Model time under lockstep ticks: each tick waits for the slowest live request."""
    queue = deque(episodes)
    live: list[deque[float]] = []
    total = 0.0
    while queue or live:
        while queue and len(live) < slots:
            live.append(deque(queue.popleft()))
        total += max(ep[0] for ep in live)
        for ep in live:
            ep.popleft()
        live = [ep for ep in live if ep]
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.environ.get("ALFWORLD_DATA"))
    p.add_argument("--games", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not args.data:
        sys.exit("set $ALFWORLD_DATA or pass --data (the valid_seen games)")
    data = Path(args.data)
    from envs.discovery import discover_games

    games = [r.game_id for r in discover_games(data, SPLIT)][: args.games]
    server = WalkthroughServer(data, games)
    rows = []
    for r in range(args.repeats):
        with FaultServer(FaultPlan(), answer=server.answer) as instant:
            env_bound, _ = play(instant.url, data, args.games, args.concurrency, args.workers)
        with FaultServer(FaultPlan(delay=lognormal_delay), answer=server.answer) as slow:
            wall, run_dir = play(slow.url, data, args.games, args.concurrency, args.workers)
            served = sum(e.delay for e in slow.events)
        episodes = list(latencies(run_dir).values())
        bound = max(env_bound, served / args.concurrency)
        ticks = tick_rule(episodes, args.concurrency)
        chain = max(map(sum, episodes))  # one episode's own answers, one after another
        tight = env_bound + min(map(sum, episodes))  # the game reset last still plays its chain
        rows.append((env_bound, served, bound, wall, ticks, sum(map(len, episodes)), chain, tight))
        print(
            f"repeat {r}: env-bound {env_bound:.1f}s, served latency {served:.1f}s "
            f"(/{args.concurrency} = {served / args.concurrency:.1f}s), bound {bound:.1f}s, "
            f"wall {wall:.1f}s = {wall / bound:.2f}x bound; tick rule model time {ticks:.1f}s "
            f"({len(episodes)} episodes, {rows[-1][5]} requests); the longest episode waited "
            f"{chain:.1f}s for its own answers; env-bound + shortest chain {tight:.1f}s "
            f"(wall {wall / tight:.2f}x)",
            flush=True,
        )
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    ratios = [row[3] / row[2] for row in rows]
    tight_ratios = [row[3] / row[7] for row in rows]
    print(
        f"\nmedians of {args.repeats}: env-bound wall {med[0]:.1f}s, total served latency "
        f"{med[1]:.1f}s, bound max(env, latency/{args.concurrency}) {med[2]:.1f}s, run wall "
        f"{med[3]:.1f}s; wall/bound {statistics.median(ratios):.2f}x (goal <= 1.15); "
        f"tick rule on the same latencies: {med[4]:.1f}s of model time alone "
        f"({med[4] / med[2]:.2f}x the bound); the longest episode's own answers, one after "
        f"another: {med[6]:.1f}s (no schedule overlaps those with each other); env-bound + the "
        f"shortest episode's answers {med[7]:.1f}s, wall/that {statistics.median(tight_ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
