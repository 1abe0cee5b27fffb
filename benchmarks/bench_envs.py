"""Env benchmark: ALFWorldEnv against raw TextWorld, its memory, and the worker pool.

Prints, as medians of repeats measured side by side in one run:
  (a) step time of ALFWorldEnv vs a raw TextWorld PddlEnv wrapped in alfworld's AlfredDemangler
      (the way alfworld builds it), on the same games and walkthrough actions (goal: <= 5% more);
  (b) load+reset time of ALFWorldEnv vs raw load+reset (ALFWorldEnv translates once, raw twice);
  (c) RSS of one env (alone in a worker process) after 10, 70, 140 games (goal: <= 200 MB, flat);
  (d) wall time of EnvPool with 2 workers vs one env, playing the same walkthroughs
      (goal: >= 1.8x on 2 free cores; the load average and the CPU cores each side actually
      got are printed alongside, since a busy shared machine caps the speedup).

    python benchmarks/bench_envs.py [--data DIR] [--games N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from envs.alfworld_env import ALFWorldEnv, game_walkthrough
from envs.discovery import discover_games
from envs.pool import EnvPool, EnvSpec, Reset
from memory.records import EnvReply

SPLIT = "eval_in_distribution"


def raw_engine() -> Any:
    """PddlEnv + AlfredDemangler, asking for what ALFWorldEnv asks for."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs.pddl import PddlEnv

    infos = textworld.EnvInfos(admissible_commands=True, won=True, feedback=True)
    return AlfredDemangler(PddlEnv(infos))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def walkthroughs(games: list[tuple[str, Path]]) -> dict[str, list[str]]:
    """Each game's walkthrough, read here from its game file (the env's replies never carry it),
    before any timing."""
    plans = {}
    for game_id, path in games:
        plan = game_walkthrough(path)
        assert plan, f"game {game_id} has no walkthrough"
        plans[game_id] = plan
    return plans


# -- (a) + (b) -------------------------------------------------------------------------------------
def time_raw(raw: Any, path: Path, t: dict[str, float]) -> None:
    began = time.perf_counter()
    raw.load(str(path))
    raw.reset()
    t["raw_reset"] += time.perf_counter() - began
    for action in raw.walkthrough:
        began = time.perf_counter()
        raw.step(action)
        t["raw_step"] += time.perf_counter() - began


def time_env(env: ALFWorldEnv, game_id: str, walkthrough: list[str], t: dict[str, float]) -> int:
    began = time.perf_counter()
    env.reset(options={"game": game_id})
    t["env_reset"] += time.perf_counter() - began
    won = False
    for action in walkthrough:
        began = time.perf_counter()
        won = env.step(action)[2]
        t["env_step"] += time.perf_counter() - began
    assert won, game_id
    return len(walkthrough)


def bench_step_and_reset(data: Path, games: list[tuple[str, Path]], repeats: int) -> None:
    """Per game: raw load+reset and walkthrough, then ALFWorldEnv's (the order swapped every
    repeat), so both see the same machine at nearly the same time."""
    env = ALFWorldEnv(data_dir=data, split=SPLIT)
    raw = raw_engine()
    plans = walkthroughs(games)
    step_ratio, reset_ratio, raw_step, env_step, raw_reset, env_reset = [], [], [], [], [], []
    for rep in range(repeats):
        t = {"raw_step": 0.0, "env_step": 0.0, "raw_reset": 0.0, "env_reset": 0.0}
        steps = 0
        for game_id, path in games:
            if rep % 2 == 0:
                time_raw(raw, path, t)
                steps += time_env(env, game_id, plans[game_id], t)
            else:
                steps += time_env(env, game_id, plans[game_id], t)
                time_raw(raw, path, t)
        step_ratio.append(t["env_step"] / t["raw_step"])
        reset_ratio.append(t["env_reset"] / t["raw_reset"])
        raw_step.append(1000 * t["raw_step"] / steps)
        env_step.append(1000 * t["env_step"] / steps)
        raw_reset.append(t["raw_reset"] / len(games))
        env_reset.append(t["env_reset"] / len(games))
    med = statistics.median
    print(
        f"(a) step: raw {med(raw_step):.1f} ms, ALFWorldEnv {med(env_step):.1f} ms per step; "
        f"overhead {100 * (med(step_ratio) - 1):+.1f}% (goal <= +5%); "
        f"ratios {', '.join(f'{r:.3f}' for r in step_ratio)}"
    )
    print(
        f"(b) load+reset: raw {med(raw_reset):.2f} s, ALFWorldEnv {med(env_reset):.2f} s per game; "
        f"ratio {med(reset_ratio):.2f}; ratios {', '.join(f'{r:.2f}' for r in reset_ratio)}"
    )


# -- (c) -----------------------------------------------------------------------------------------
def bench_rss(data: Path, games: list[tuple[str, Path]], marks: tuple[int, ...]) -> None:
    """One env alone in a worker process plays every walkthrough; its RSS is read from /proc."""
    spec = EnvSpec("alfworld", {"data_dir": data, "split": SPLIT})
    plans = walkthroughs(games)
    readings: list[str] = []
    with EnvPool(spec, workers=1, timeout_s=300) as pool:
        for n, (game_id, _) in enumerate(games, start=1):
            result = pool.reset(0, game_id)
            for action in plans[game_id]:
                result = pool.step(0, action)
            assert result.info["won"], game_id
            if n in marks or n == 1:
                pid = pool.pid(0)
                assert pid is not None
                readings.append(f"{n} games {rss_mb(pid):.0f} MB")
    print(f"(c) RSS of one env: {'; '.join(readings)} (goal <= 200 MB, flat)")


# -- (d) -----------------------------------------------------------------------------------------
def play_sequential(env: ALFWorldEnv, plans: dict[str, list[str]]) -> float:
    began = time.perf_counter()
    for game_id, walkthrough in plans.items():
        env.reset(options={"game": game_id})
        for action in walkthrough:
            env.step(action)
    return time.perf_counter() - began


def play_pool(pool: EnvPool, plans: dict[str, list[str]]) -> float:
    """Each slot takes the next game as soon as its episode is won: no slot waits for another."""
    began = time.perf_counter()
    queue = deque(plans)
    left: dict[int, deque[str]] = {}  # the actions left in each slot's episode
    resetting = {slot for slot in range(pool.slots) if queue}
    pool.submit({slot: Reset(queue.popleft()) for slot in sorted(resetting)})
    while pool.in_flight:
        calls: dict[int, str | Reset] = {}
        for slot, result in pool.collect().items():
            if not isinstance(result, EnvReply):
                raise result
            if slot in resetting:
                resetting.discard(slot)
                left[slot] = deque(plans[str(result.info["game"])])
            if left[slot]:
                calls[slot] = left[slot].popleft()
            elif queue:
                assert result.info["won"]
                resetting.add(slot)
                calls[slot] = Reset(queue.popleft())
        if calls:
            pool.submit(calls)
    return time.perf_counter() - began


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_pool(data: Path, games: list[tuple[str, Path]], workers: int, repeats: int) -> None:
    """Also reports the CPU cores each side got (CPU seconds / wall seconds): on a shared
    machine with autogroup scheduling a session gets its share however many processes it runs,
    which caps the speedup below the number of workers."""
    spec = EnvSpec("alfworld", {"data_dir": data, "split": SPLIT})
    env = ALFWorldEnv(**spec.kwargs)
    plans = walkthroughs(games)
    game_ids = list(plans)
    seq, par, ratio, seq_cores, par_cores = [], [], [], [], []
    with EnvPool(spec, workers=workers, timeout_s=300) as pool:
        # warm up: the workers import TextWorld once; not part of either timing
        pool.reset_many({slot: Reset(game_ids[-1 - slot]) for slot in range(workers)})
        env.reset(options={"game": game_ids[-1]})
        pids = [pool.pid(slot) or 0 for slot in range(workers)]

        def sequential() -> float:
            cpu = os.times()
            wall = play_sequential(env, plans)
            now = os.times()
            seq_cores.append((now.user + now.system - cpu.user - cpu.system) / wall)
            return wall

        def pooled() -> float:
            cpu = sum(cpu_s(pid) for pid in pids)
            wall = play_pool(pool, plans)
            par_cores.append((sum(cpu_s(pid) for pid in pids) - cpu) / wall)
            return wall

        for rep in range(repeats):
            if rep % 2 == 0:
                s, p = sequential(), pooled()
            else:
                p, s = pooled(), sequential()
            seq.append(s)
            par.append(p)
            ratio.append(s / p)
        assert pool.restarts == 0
    med = statistics.median
    print(
        f"(d) {len(game_ids)} walkthroughs: one env {med(seq):.1f} s, EnvPool({workers} workers) "
        f"{med(par):.1f} s; speedup {med(ratio):.2f}x (goal >= 1.8x on 2 free cores); "
        f"ratios {', '.join(f'{r:.2f}' for r in ratio)}; cores used: one env "
        f"{med(seq_cores):.2f}, pool {med(par_cores):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--data", default=os.environ.get("ALFWORLD_DATA", "../shared/alfworld_data")
    )
    parser.add_argument("--games", type=int, default=140, help="games for (c), at most 140")
    parser.add_argument("--step-games", type=int, default=10, help="games for (a) and (b)")
    parser.add_argument("--pool-games", type=int, default=40, help="games for (d)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default="abcd", help="which parts to run, e.g. 'ad'")
    args = parser.parse_args()
    data = Path(args.data)
    records = discover_games(data, SPLIT)
    games = [(r.game_id, r.path) for r in records]
    # spread the picks over the task types (game ids are sorted by task folder)
    pick = lambda n: games[:: max(1, len(games) // max(1, n))][:n]  # noqa: E731
    print(f"{len(games)} {SPLIT} games under {data}; {load()}")
    if "a" in args.only or "b" in args.only:
        bench_step_and_reset(data, pick(args.step_games), args.repeats)
    if "c" in args.only:
        n = min(args.games, len(games))
        marks = tuple(m for m in (10, 70, 140) if m < n) + (n,)
        bench_rss(data, games[:n], marks)
    if "d" in args.only:
        bench_pool(data, pick(args.pool_games), args.workers, args.repeats)
    print(f"done; {load()}")


if __name__ == "__main__":
    main()
