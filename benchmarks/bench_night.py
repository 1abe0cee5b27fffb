"""A night against the GPU stand-in: how busy the harness keeps one simulated H100.

Reflexion (``--trials`` 3) on the valid_seen games, ``--concurrency`` 128 and 256 episodes in
flight, against the GPU stand-in of ``tests/support/gpu_standin.py`` (the 8B/H100 preset, its
iterations lasting their simulated time times ``--time-scale``; answers from
``scripted:random``):

- served: the stand-in behind its OpenAI-compatible server (in this process), the runner in a
  child with ``--model openai:standin --base-url``;
- in process: the stand-in as an async backend inside the runner's process, as vLLM's async
  engine is (the runner is the same command, its ``scripted:random`` backend swapped for it).

Printed per mode and concurrency, as medians of ``--repeats``:

- GPU-busy fraction: time with a non-empty batch over the run's wall time, and over the part
  before the final tail (the tail starts when the batch last held half the concurrency);
- wall time against the bound: max(the stand-in's own busy time, the longest chain of one
  game's calls, answered one after the other);
- where the GPU idles: start-up (before the first request), gaps (an empty batch before the
  tail: every episode in flight waiting on something else), the tail, and the end (after
  the last answer: the report);
- the runner's CPU per step (all of it, start-up included; the stand-in's own thread left out
  in process), the CPU per step of everything else the run started (its env workers, and with
  ``--harness-procs`` its runner processes: the machine's busy time, from ``/proc/stat``, less
  the runner's and this process's), how busy the machine's cores were over the run's wall time,
  and steps a second.
  ``bench_harness.py`` splits the marginal cost by part.

``--harness-procs 1 2`` runs the served mode with each number of runner processes.

``--time-scale`` makes the simulated GPU slower (> 1) or faster (< 1) than an H100: the busy
fraction means something only when the GPU's demand is within what this machine's cores can
feed (the env workers and the runner share them).

Each env worker keeps every game's parsed state (``--reset-cache``, default: the games' count):
the run's own default (8) makes every later trial load its game again.

``--translation-cache off cold warm`` runs each setting side by side: ``off`` translates every
game a worker loads; ``cold`` gives each run an empty translation cache (each game translated
once, by the first worker that loads it); ``warm`` one filled before the repeats start (a later
night on the same games: none is translated).

    python benchmarks/bench_night.py [--data DIR] [--games 140] [--trials 3] [--time-scale 4]
        [--concurrency 128 256] [--repeats 3] [--modes served inproc] [--reset-cache N]
        [--harness-procs 1 2] [--translation-cache off cold warm]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from timing import child_result, data_parser, machine_cpu_s

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the stand-in: tests/support

SPLIT = "eval_in_distribution"

# The child: the command line's entry; in process with the stand-in as its model backend.
CHILD = r"""
import json, resource, sys, time
args, inproc, preset, scale = json.loads(sys.argv[1])
live = None
if inproc:
    import experiments.runner as runner
    from tests.support.gpu_standin import LiveEngine, StandinBackend, PRESETS
    live = LiveEngine(PRESETS[preset], time_scale=scale)
    made = runner.make_backend
    def make_backend(spec, **options):
        if spec.startswith("scripted:"):
            return StandinBackend(live, spec.split(":", 1)[1], options.get("ground_truth"))
        return made(spec, **options)
    runner.make_backend = make_backend
from experiments.cli import main
began = time.monotonic()
code = main(args)
ended = time.monotonic()
u = resource.getrusage(resource.RUSAGE_SELF)
out = {"code": code, "cpu_s": u.ru_utime + u.ru_stime, "began": began, "ended": ended}
if live is not None:
    live.stop()
    out["standin_cpu_s"] = live.cpu_s
    out["timeline"] = live.timeline
print("BENCH " + json.dumps(out))
"""


def run_child(args: list[str], inproc: bool, preset: str, scale: float) -> dict:
    payload = json.dumps([args, inproc, preset, scale])
    return child_result([sys.executable, "-c", CHILD, payload], ROOT)


def chain_and_steps(run_dir: Path) -> tuple[float, int]:
    """The longest chain of one game's calls (their latencies summed) and the steps played."""
    from experiments.store import RunReader

    with RunReader(run_dir) as reader:
        per_game: dict[str, float] = {}
        for call in reader.model_calls():
            per_game[call.game] = per_game.get(call.game, 0.0) + call.latency_s
        steps = sum(len(reader.steps(e.episode_id)) for e in reader.episodes())
    return max(per_game.values(), default=0.0), steps


def measure(
    out: dict, timeline: list, concurrency: int, chain: float, steps: int, cpu: dict
) -> dict:
    """The run's figures from the stand-in's iterations (wall start, end, sequences); ``cpu``:
    this process's CPU during the run (``here``; served: the stand-in and its server) and the
    whole machine's (``machine``)."""
    wall = out["ended"] - out["began"]
    busy = sum(e - s for s, e, _ in timeline)
    first, last = timeline[0][0], timeline[-1][1]
    full = [e for s, e, n in timeline if n >= concurrency / 2]
    tail = max(full) if full else first
    before_tail = sum(min(e, tail) - s for s, e, _ in timeline if s < tail)
    runner = out["cpu_s"] - out.get("standin_cpu_s", 0.0)
    rest = cpu["machine"] - out["cpu_s"] - cpu["here"]  # the env workers (and runner processes)
    bound = max(busy, chain)
    return {
        "busy": busy / wall,
        "busy_before_tail": before_tail / (tail - first) if tail > first else 0.0,
        "wall_s": wall,
        "bound_s": bound,
        "wall_over_bound": wall / bound if bound else 0.0,
        "idle_startup_s": first - out["began"],
        "idle_gaps_s": (tail - first) - before_tail,
        "idle_tail_s": (last - tail) - (busy - before_tail),
        "idle_end_s": out["ended"] - last,
        "cpu_ms_per_step": 1000 * runner / steps,
        "other_cpu_ms_per_step": 1000 * rest / steps,
        "cores_busy": cpu["machine"] / (wall * (os.cpu_count() or 1)),
        "steps_per_s": steps / wall,
        "steps": steps,
    }


def warm_translations(cfg: dict, root: Path) -> None:
    """Fill ``root`` with the translations of the night's games (as an earlier night would)."""
    from envs.alfworld_env import ALFWorldEnv

    env = ALFWorldEnv(cfg["data"], SPLIT, reset_cache=1, translation_cache=root)
    for game in env.game_ids[: cfg["games"]]:
        env.reset(options={"game": game})
    env.close()


def one_run(
    cfg: dict, mode: str, concurrency: int, procs: int = 1, translations: str = "off"
) -> dict:
    from tests.support.fault_server import FaultPlan, FaultServer
    from tests.support.gpu_standin import PRESETS, LiveEngine, text_policy

    here, machine = time.process_time(), machine_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cache = {"off": "off", "cold": str(Path(tmp) / "translations")}.get(
            translations, translations
        )
        args = [
            "run", "--agent", "reflexion", "--data", str(cfg["data"]), "--split", SPLIT,
            "--games", str(cfg["games"]), "--trials", str(cfg["trials"]),
            "--max-steps", str(cfg["max_steps"]), "--concurrency", str(concurrency),
            "--workers", str(cfg["workers"]), "--run-dir", str(run_dir),
            "--reset-cache", str(cfg["reset_cache"]), "--harness-procs", str(procs),
            "--translation-cache", cache,
        ]  # fmt: skip
        if mode == "inproc":
            out = run_child(
                [*args, "--model", "scripted:random"], True, cfg["preset"], cfg["scale"]
            )
            timeline = out["timeline"]
        else:
            live = LiveEngine(PRESETS[cfg["preset"]], time_scale=cfg["scale"])
            server = FaultServer(FaultPlan(), answer=text_policy("random"), engine=live).start()
            try:
                served = [*args, "--model", "openai:standin", "--base-url", server.url]
                out = run_child(served, False, cfg["preset"], cfg["scale"])
            finally:
                server.stop()
                live.stop()
            timeline = live.timeline
        chain, steps = chain_and_steps(run_dir)
    cpu = {"here": time.process_time() - here, "machine": machine_cpu_s() - machine}
    return measure(out, timeline, concurrency, chain, steps, cpu)


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--games", type=int, default=140)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--reset-cache", type=int, default=None, help="games each env worker keeps (default: all)"
    )
    parser.add_argument("--preset", default="h100-8b")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--modes", nargs="+", default=["served", "inproc"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--harness-procs", type=int, nargs="+", default=[1], help="served: runner processes"
    )
    parser.add_argument(
        "--translation-cache", nargs="+", default=["cold"], choices=["off", "cold", "warm"]
    )
    a = parser.parse_args()
    cfg = {
        "data": a.data, "games": a.games, "trials": a.trials, "max_steps": a.max_steps,
        "workers": a.workers, "preset": a.preset, "scale": a.time_scale,
        "reset_cache": a.games if a.reset_cache is None else a.reset_cache,
    }  # fmt: skip
    results: dict[tuple[str, int], list[dict]] = {}
    settings = [(mode, c, n, t) for mode in a.modes for c in a.concurrency
                for n in (a.harness_procs if mode == "served" else [1])
                for t in a.translation_cache]  # fmt: skip
    with tempfile.TemporaryDirectory() as warm:
        if "warm" in a.translation_cache:
            warm_translations(cfg, Path(warm))
        for _ in range(a.repeats):  # side by side: every setting in each repeat
            for mode, c, n, t in settings:
                r = one_run(cfg, mode, c, n, warm if t == "warm" else t)
                name = (mode if n == 1 else f"{mode} x{n}") + f" {t}"
                results.setdefault((name, c), []).append(r)
                line = ", ".join(f"{k} {v:.3g}" for k, v in r.items())
                print(f"  {name} c={c}: {line}", flush=True)
    print(
        f"\n{a.games} games x {a.trials} trials, Reflexion, {a.preset} x{a.time_scale:g} "
        f"time scale, reset cache {cfg['reset_cache']}, medians of {a.repeats}:"
    )
    keys = ["busy", "busy_before_tail", "wall_s", "bound_s", "wall_over_bound", "idle_startup_s",
            "idle_gaps_s", "idle_tail_s", "idle_end_s", "cpu_ms_per_step", "other_cpu_ms_per_step",
            "cores_busy", "steps_per_s"]  # fmt: skip
    print(f"{'':<24}" + "".join(f"{k:>20}" for k in keys))
    for (mode, c), rs in results.items():
        row = [statistics.median(r[k] for r in rs) for k in keys]
        print(f"{mode + ' ' + str(c):<24}" + "".join(f"{v:>20.3f}" for v in row))


if __name__ == "__main__":
    main()
