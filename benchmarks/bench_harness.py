"""The harness's own CPU per step: what one runner process spends to drive a step, model aside.

The runner plays valid_seen games (one trial, ``--max-steps`` 20, ``--concurrency`` 64) with
``scripted:random`` in process, and through the OpenAI-compatible backend against a loopback
server that answers at once (the same policy; the server runs in this process, the runner in a
child, so only the runner's CPU is counted). The env workers are other processes: not counted.
The cost per step is marginal, between a small and a large run (8 and 64 games by default), so
start-up, imports and the game loads of the first resets fall out.

Printed, as medians of ``--repeats`` measured side by side in one run:

- runner CPU per step (user + system, ``getrusage(RUSAGE_SELF)`` of the child), in process and
  served, beside the goals (0.5 ms and 1 ms), split in two: while the run plays (what keeps a
  GPU fed: the child reads its CPU as ``RunSession.run``'s play, ``experiments.session.execute``,
  begins and ends) and after it (the end report and the viewer's page, written once the model
  is done), and the whole (the env workers' own CPU, ~4 ms an ALFWorld step, is
  ``bench_fast_step.py``'s);
- steps a second one runner process could drive while it plays (1 / CPU per step played), and
  the H100 figure it must feed (~500 actor requests a second at batch 128);
- with ``--parts`` (``pip install py-spy``): one more large run of each, sampled by py-spy (the
  thread holding the GIL, 1,000 a second), start-up and the end report left out, the samples
  split by part (the scripted model itself, store, HTTP client, tokenization, env client, prompt
  building, event loop, agent and engine, other) as shares of the cost while playing, and the
  harness alone (the cost less the scripted model's share);
- with ``--against DIR``: the same for another commit's checkout (``git worktree add DIR
  COMMIT``), each repeat running both, and this tree's figures as ratios of its: on this noisy
  machine a ratio measured side by side holds where an absolute time drifts by a third over a
  day. Its code runs in this venv, so the venv needs what that commit needs (the commit before
  the work on the harness, ``9ba29d6``: ``pip install tenacity``).

    python benchmarks/bench_harness.py [--data DIR] [--small 8] [--large 64] [--repeats 3]
        [--parts] [--against DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from timing import child_result, data_parser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the loopback server: tests/support

SPLIT = "eval_in_distribution"
GOAL_MS = {"in process": 0.5, "served": 1.0}

# The child: run the command line's entry, then print its own CPU seconds: in all, and when the
# run's play began and ended (the session's ``execute``, wrapped: start-up before it, the end
# report after it).
CHILD = r"""
import json, resource, sys
import experiments.session as session

def cpu_s():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

marks = {}
play = session.execute

def timed(*args, **kwargs):
    marks["play_from"] = cpu_s()
    try:
        play(*args, **kwargs)
    finally:
        marks["play_to"] = cpu_s()

session.execute = timed
from experiments.cli import main
code = main(json.loads(sys.argv[1]))
print("BENCH " + json.dumps({"code": code, "cpu_s": cpu_s(), **marks}))
"""
PHASES = ("playing", "after (report)", "in all")


def phases(out: dict) -> dict[str, float]:
    """A child's CPU seconds while it played, after its play (the end report), and in all."""
    played = out["play_to"] - out["play_from"]
    return {PHASES[0]: played, PHASES[1]: out["cpu_s"] - out["play_to"], PHASES[2]: out["cpu_s"]}


# What a frame of a sampled stack is part of, by its file; the innermost frame that names a part
# decides (a generic frame, e.g. json or dataclasses, counts for the part of the frame that
# called it). Checked in this order.
FIXED = "start-up and report"  # outside the play: imports, game discovery, the end report
MODEL = "the model (scripted)"  # the stand-in for the GPU, not the harness
PARTS = (
    (FIXED, ("<frozen importlib", "experiments/report.py", "experiments/viewer/", "matplotlib/",
             "envs/discovery.py")),
    (MODEL, ("agents/llm/scripted.py",)),
    ("store (SQLite)", ("experiments/store.py", "sqlite3/")),
    ("HTTP client", ("aiohttp/", "aiohappyeyeballs/", "multidict/", "yarl/", "httpx/",
                     "httpcore/", "openai/", "h11/", "anyio/", "ssl.py", "socket.py",
                     "agents/llm/openai_backend.py", "agents/llm/aio_http.py",
                     "agents/llm/deadline.py", "agents/llm/retry.py")),
    ("tokenization", ("tokenizers/", "tiktoken/")),
    ("env client", ("envs/", "multiprocessing/", "pickle")),
    ("prompt building", ("agents/layout.py", "agents/prompting.py", "agents/reflexion.py",
                         "agents/memory_policy.py", "agents/parsing.py", "agents/reflexion_code.py")),
    ("event loop", ("asyncio/", "selectors.py")),
    ("agent and engine", ("/agents/", "/experiments/", "/memory/")),
)  # fmt: skip


def part_of(stack: list[str]) -> str:
    """The part a sampled stack (root first, ``func (file:line)`` frames) is spent in."""
    if any(m in frame for frame in stack for m in PARTS[0][1]):
        return FIXED
    for frame in reversed(stack):
        for name, marks in PARTS:
            if any(m in frame for m in marks):
                return name
    return "other"


def run_child(args: list[str], sample_to: Path | None = None, root: Path = ROOT) -> dict:
    """Run the command in a child (the code of the checkout ``root``); with ``sample_to``,
    under py-spy (its raw stacks there)."""
    cmd = [sys.executable, "-c", CHILD, json.dumps(args)]
    if sample_to is not None:
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.exists():
            raise SystemExit("--parts samples with py-spy: pip install py-spy")
        sampling = ["record", "--gil", "-r", "1000", "-f", "raw", "-o", str(sample_to), "--"]
        cmd = [str(spy), *sampling, *cmd]
    return child_result(cmd, root)


def sampled_parts(raw: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Samples by part, and by innermost frame (start-up and the end report left out), from
    py-spy's raw output (``--gil``: only the thread holding the GIL is sampled, so a thread
    that waits is never counted)."""
    parts: dict[str, int] = {}
    leaves: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        part = part_of(frames)
        parts[part] = parts.get(part, 0) + int(count)
        if part != FIXED:
            leaf = frames[-1] or "(no Python frame)"
            leaves[leaf] = leaves.get(leaf, 0) + int(count)
    return parts, leaves


def steps_of(run_dir: Path) -> int:
    from experiments.store import RunReader

    with RunReader(run_dir) as reader:
        return sum(len(reader.steps(e.episode_id)) for e in reader.episodes())


def one_run(
    data: Path, games: int, served: str | None, sample_to: Path | None = None, root: Path = ROOT
) -> tuple[dict, int]:
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
        out = run_child(args, sample_to, root)
        return out, steps_of(run_dir)


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--large", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="split the cost by part (py-spy)")
    parser.add_argument(
        "--against",
        type=Path,
        help="a checkout of another commit (git worktree add DIR COMMIT), measured side by side",
    )
    args = parser.parse_args()
    from tests.support.fault_server import FaultPlan, FaultServer
    from tests.support.gpu_standin import text_policy

    trees = {"this tree": ROOT}
    if args.against is not None:
        if not (args.against / "experiments" / "cli.py").is_file():
            raise SystemExit(f"--against {args.against}: not a checkout of this project")
        trees["against"] = args.against.resolve()
    server = FaultServer(FaultPlan(), answer=text_policy("random")).start()
    try:
        modes = {"in process": None, "served": server.url}
        per_step: dict[tuple[str, str, str], list[float]] = {}
        for _ in range(args.repeats):  # side by side: each repeat runs every mode of every tree
            for mode, url in modes.items():
                for tree, root in trees.items():
                    small, n_small = one_run(args.data, args.small, url, root=root)
                    large, n_large = one_run(args.data, args.large, url, root=root)
                    a, b = phases(small), phases(large)
                    for phase in PHASES:
                        per_step.setdefault((tree, mode, phase), []).append(
                            (b[phase] - a[phase]) / (n_large - n_small)
                        )
                    print(
                        f"  {tree}, {mode}: {args.small} games {n_small} steps"
                        f" {small['cpu_s']:.2f} s CPU, {args.large} games {n_large} steps"
                        f" {large['cpu_s']:.2f} s CPU ({b[PHASES[0]]:.2f} s of it playing)",
                        flush=True,
                    )
        print(
            f"\nrunner CPU per step (marginal, {args.small} -> {args.large} games), ms, medians"
            f" of {args.repeats}:"
        )
        print(
            f"{'tree':<10} {'mode':<11} {'playing':>8} {'goal':>6} {'after':>7} {'in all':>7}"
            f" {'steps/s/process':>16}  (one H100: ~500/s)"
        )
        ms = {k: statistics.median(v) * 1000 for k, v in per_step.items()}
        for tree in trees:
            for mode in modes:
                playing, after, whole = (ms[tree, mode, p] for p in PHASES)
                print(
                    f"{tree:<10} {mode:<11} {playing:>8.3f} {GOAL_MS[mode]:>6.1f} {after:>7.3f}"
                    f" {whole:>7.3f} {1000 / playing:>16.0f}"
                )
        if len(trees) > 1:
            print("\nthis tree / against (ratios of the medians):")
            for mode in modes:
                ratios = "  ".join(
                    f"{p} {ms['this tree', mode, p] / ms['against', mode, p]:.2f}"
                    for p in (PHASES[0], PHASES[2])
                )
                print(f"  {mode:<11} {ratios}")
        medians = {mode: ms["this tree", mode, PHASES[0]] for mode in modes}
        if args.parts:
            with tempfile.TemporaryDirectory() as tmp:
                for mode, url in modes.items():
                    raw = Path(tmp) / f"{mode}.txt"
                    one_run(args.data, args.large, url, sample_to=raw)
                    parts, leaves = sampled_parts(raw)
                    fixed = parts.pop(FIXED, 0)
                    total = sum(parts.values()) or 1
                    print(
                        f"\n{mode}: CPU by part ({args.large} games, py-spy; {fixed} samples of "
                        f"start-up and the end report left out; shares of the cost while playing):"
                    )
                    for name, c in sorted(parts.items(), key=lambda kv: -kv[1]):
                        ms = medians[mode] * c / total
                        print(f"  {name:<20} {100 * c / total:5.1f}%  {ms:6.3f} ms")
                    model = parts.get(MODEL, 0)
                    print(f"  the harness alone: {medians[mode] * (total - model) / total:.3f} ms")
                    print("  innermost frames with the most samples:")
                    for key, c in sorted(leaves.items(), key=lambda kv: -kv[1])[:20]:
                        print(f"    {100 * c / total:5.1f}%  {key[-100:]}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
