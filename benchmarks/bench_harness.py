"""The harness's own CPU per step: what one runner process spends to drive a step, model aside.

The runner plays valid_seen games (one trial, ``--max-steps`` 20, ``--concurrency`` 64) with
``scripted:random`` in process, and through the OpenAI-compatible backend against a loopback
server that answers at once (the same policy; the server runs in this process, the runner in a
child, so only the runner's CPU is counted). The env workers are other processes: not counted.
The cost per step is marginal, between a small and a large run (8 and 64 games by default), so
start-up, imports and the game loads of the first resets fall out.

Printed, as medians of ``--repeats`` measured side by side in one run:

- runner CPU per step (user + system, ``getrusage(RUSAGE_SELF)`` of the child), in process and
  served, beside the goals (0.5 ms and 1 ms);
- steps a second one runner process could drive at that cost (1 / CPU per step), and the H100
  figure it must feed (~500 actor requests a second at batch 128);
- with ``--parts``: one more large run of each, under cProfile, its self time split by part
  (event loop, store, prompt building, tokenization, HTTP client, env client, agent and engine,
  other), as shares applied to the unprofiled cost.

    python benchmarks/bench_harness.py [--data DIR] [--small 8] [--large 64] [--repeats 3] [--parts]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import data_parser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the loopback server: tests/support

SPLIT = "eval_in_distribution"
GOAL_MS = {"in process": 0.5, "served": 1.0}

# The child: run the command line's entry, then print its own CPU seconds and, profiled, its
# self time by file.
CHILD = r"""
import cProfile, json, pstats, resource, sys
from experiments.cli import main
args = json.loads(sys.argv[1])
profile = sys.argv[2] == "1"
prof = cProfile.Profile() if profile else None
if prof: prof.enable()
code = main(args)
if prof: prof.disable()
u = resource.getrusage(resource.RUSAGE_SELF)
out = {"code": code, "cpu_s": u.ru_utime + u.ru_stime}
if prof:
    by_file = {}
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in pstats.Stats(prof).stats.items():
        key = file if file != "~" else "builtin:" + func
        by_file[key] = by_file.get(key, 0.0) + tt
    out["self_s"] = by_file
print("BENCH " + json.dumps(out))
"""

# Which part of the harness a file (or a builtin) is, first match wins.
PARTS = (
    ("store (SQLite)", ("experiments/store", "sqlite3", "builtin:<method 'execute", "builtin:<method 'commit", "json/")),
    ("prompt building", ("agents/layout", "agents/prompting", "agents/reflexion", "agents/memory_policy", "agents/parsing")),
    ("tokenization", ("rough_token_count", "agents/llm/common", "tokenizers", "tiktoken")),
    ("HTTP client", ("httpx", "httpcore", "openai/", "h11", "anyio", "agents/llm/openai_backend", "ssl", "http/")),
    ("env client", ("envs/", "multiprocessing", "pickle", "builtin:<method 'recv", "builtin:<method 'send")),
    ("event loop", ("asyncio/", "selectors", "builtin:<method 'poll", "builtin:<method 'select", "threading")),
    ("agent and engine", ("agents/", "experiments/", "memory/")),
)  # fmt: skip


def part_of(key: str) -> str:
    for name, marks in PARTS:
        if any(m in key for m in marks):
            return name
    return "other"


def run_child(args: list[str], profile: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args), "1" if profile else "0"],
        capture_output=True, text=True, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the runner failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(line[len("BENCH ") :])
    if out["code"] != 0:
        raise SystemExit(f"the runner exited {out['code']}: {done.stderr[-2000:]}")
    return out


def steps_of(run_dir: Path) -> int:
    from experiments.store import RunReader

    with RunReader(run_dir) as reader:
        return sum(len(reader.steps(e.episode_id)) for e in reader.episodes())


def one_run(data: Path, games: int, served: str | None, profile: bool = False) -> tuple[dict, int]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [
            "run", "--data", str(data), "--split", SPLIT, "--games", str(games), "--trials", "1",
            "--max-steps", "20", "--concurrency", "64", "--workers", "2",
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        if served is None:
            args += ["--model", "scripted:random"]
        else:
            args += ["--model", "openai:standin", "--base-url", served]
        out = run_child(args, profile)
        return out, steps_of(run_dir)


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--large", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="split the cost by part (cProfile)")
    args = parser.parse_args()
    from tests.support.fault_server import FaultPlan, FaultServer
    from tests.support.gpu_standin import text_policy

    server = FaultServer(FaultPlan(), answer=text_policy("random")).start()
    try:
        modes = {"in process": None, "served": server.url}
        per_step: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):  # side by side: each repeat runs every mode
            for mode, url in modes.items():
                small, n_small = one_run(args.data, args.small, url)
                large, n_large = one_run(args.data, args.large, url)
                per_step[mode].append((large["cpu_s"] - small["cpu_s"]) / (n_large - n_small))
                print(
                    f"  {mode}: {args.small} games {n_small} steps {small['cpu_s']:.2f} s CPU, "
                    f"{args.large} games {n_large} steps {large['cpu_s']:.2f} s CPU",
                    flush=True,
                )
        print(
            f"\nrunner CPU per step (marginal, {args.small} -> {args.large} games), medians of {args.repeats}:"
        )
        print(
            f"{'mode':<12} {'ms/step':>8} {'goal':>6} {'steps/s/process':>16}  (one H100: ~500/s)"
        )
        medians = {}
        for mode, xs in per_step.items():
            ms = statistics.median(xs) * 1000
            medians[mode] = ms
            print(f"{mode:<12} {ms:>8.3f} {GOAL_MS[mode]:>6.1f} {1000 / ms:>16.0f}")
        if args.parts:
            for mode, url in modes.items():
                out, _ = one_run(args.data, args.large, url, profile=True)
                shares: dict[str, float] = {}
                for key, t in out["self_s"].items():
                    shares[part_of(key)] = shares.get(part_of(key), 0.0) + t
                total = sum(shares.values())
                print(f"\n{mode}: self time by part ({args.large} games, profiled), as ms/step:")
                for name, t in sorted(shares.items(), key=lambda kv: -kv[1]):
                    print(f"  {name:<18} {100 * t / total:5.1f}%  {medians[mode] * t / total:6.3f}")
                top = sorted(out["self_s"].items(), key=lambda kv: -kv[1])[:15]
                print("  top files/builtins by self time:")
                for key, t in top:
                    print(f"    {t:7.2f} s  {key[-90:]}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
