"""The runner's CPU per env call: what an episode's step costs the runner process to send to an
env worker and get back, the env's own work aside (it runs in the worker).

64 episodes step at once through the runner's pool (``AsyncEnvPool`` over ``EnvPool``, 2 worker
processes) an env whose step spins ~0.5 ms in the worker and answers what an ALFWorld step
answers (an observation, 22 admissible commands, the task and the game's path). Printed, as
medians of ``--repeats``: the runner's CPU per call (``time.process_time``, so the workers' CPU
is not in it), and beside it the floor a pipe sets: the same answer pickled, sent and received
through a ``multiprocessing`` pipe within one process (one send, one receive, no event loop).

    python benchmarks/bench_env_client.py [--calls 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any

from envs.aio import AsyncEnvPool
from envs.pool import EnvPool, EnvSpec, Reset
from memory.records import EnvReply

SLOTS, WORKERS = 64, 2
ADMISSIBLE = [f"go to cabinet {i}" for i in range(20)] + ["look", "inventory"]
INFO = {
    "admissible_commands": ADMISSIBLE,
    "won": False,
    "task": "put a clean apple in fridge",
    "game": "json_2.1.1/valid_seen/pick_clean_then_place_in_recep-Apple-None-Fridge-1/trial_1",
}
OBSERVATION = "You arrive at cabinet 3. On the cabinet 3, you see a bowl 1, and a mug 2."


class BusyEnv:
    """Spins ~0.5 ms a step and answers as an ALFWorld step does."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        return "awake", dict(INFO)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        end = time.perf_counter() + 0.0005
        while time.perf_counter() < end:
            pass
        return OBSERVATION, 0.0, False, False, dict(INFO)


async def client_us(calls: int) -> float:
    """The runner's CPU per call, in microseconds."""
    pool = EnvPool(EnvSpec("bench_env_client:BusyEnv"), workers=WORKERS, slots=SLOTS)
    envs = AsyncEnvPool(pool)
    try:
        await asyncio.gather(*(envs.call(s, Reset(f"g{s}")) for s in range(SLOTS)))

        async def play(slot: int) -> None:
            for _ in range(calls):
                await envs.call(slot, "go to cabinet 3")

        began = time.process_time()
        await asyncio.gather(*(play(s) for s in range(SLOTS)))
        return (time.process_time() - began) / (SLOTS * calls) * 1e6
    finally:
        envs.close()
        pool.close()


def pipe_us(n: int = 4000) -> float:
    """The floor: one answer pickled, sent and received through a pipe, in microseconds."""
    a, b = multiprocessing.Pipe()
    reply = ("ok", 3, EnvReply(OBSERVATION, 0.0, False, False, dict(INFO)))
    began = time.process_time()
    for _ in range(n):
        a.send(reply)
        b.recv()
    return (time.process_time() - began) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60, help="calls per episode")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    client, floor = [], []
    for _ in range(args.repeats):
        client.append(asyncio.run(client_us(args.calls)))
        floor.append(pipe_us())
        print(f"  client {client[-1]:.1f} us a call, pipe {floor[-1]:.1f} us", flush=True)
    c, f = statistics.median(client), statistics.median(floor)
    print(
        f"\nrunner CPU per env call ({SLOTS} episodes, {WORKERS} workers, medians of "
        f"{args.repeats}): {c:.1f} us; a bare pipe round trip of the answer: {f:.1f} us "
        f"({c / f:.1f}x the floor)"
    )


if __name__ == "__main__":
    main()
