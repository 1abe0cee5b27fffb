"""Steps a second with the run spread over N runner processes (``--harness-procs``) against one.

The same run each time: valid_seen games, one trial, ``--max-steps`` 20, the run's
``--concurrency`` and ``--workers`` (split among the processes), answered by ``scripted:random``
in each process, or through the OpenAI-compatible backend by a loopback server in this process
that answers at once (so the harness, not a model, sets the pace). The rate is the run's steps
over the time from its first step to its last (from the store: start-up and the end report fall
out), as medians of ``--repeats`` measured side by side (each repeat runs every setting).

``--on-ray`` adds each N above one as Ray actors (``--harness-procs-on-ray``) on a private local
Ray cluster this script starts once (its daemons' CPU is counted as the runs' only through the
cores they leave).

Printed beside it: how busy the machine's cores were during the run (``/proc/stat``: the runner,
its runner processes and env workers, the loopback server and Ray's daemons, over cores x
wall): N processes can add steps only while cores are left over (the env workers, ~4 ms of CPU
an ALFWorld step, and the loopback server share them).

    python benchmarks/bench_procs.py [--data DIR] [--games 64] [--procs 1 2] [--repeats 3]
        [--modes served inproc] [--concurrency 64] [--workers 2] [--on-ray]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import SPLIT, run_child
from timing import data_parser, machine_cpu_s

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the loopback server: tests/support


def play_rate(run_dir: Path) -> tuple[float, int]:
    """Steps a second from the run's first step to its last, and the steps."""
    from experiments.store import RunReader

    with RunReader(run_dir) as reader:
        first, last, n = reader.conn.execute(
            "SELECT MIN(created_at), MAX(created_at), COUNT(*) FROM steps"
        ).fetchone()
    return (n - 1) / (last - first), n


def one_run(
    a: argparse.Namespace, procs: int, url: str | None, ray: str | None = None
) -> tuple[float, int, float]:
    """The run's steps a second and steps, and how busy the machine's cores were while it ran
    (``/proc/stat``: every process, its env workers and Ray's daemons included, over the
    cores' time)."""
    began, cpu = time.perf_counter(), machine_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            "run", "--data", str(a.data), "--split", SPLIT, "--games", str(a.games),
            "--trials", "1", "--max-steps", "20", "--concurrency", str(a.concurrency),
            "--workers", str(a.workers), "--harness-procs", str(procs),
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        if ray is not None:
            cmd += ["--harness-procs-on-ray", "--ray", ray]
        cmd += ["--model", "scripted:random"] if url is None else [
            "--model", "openai:standin", "--base-url", url,
        ]  # fmt: skip
        run_child(cmd)
        wall, cpu = time.perf_counter() - began, machine_cpu_s() - cpu
        return (*play_rate(run_dir), cpu / (wall * (os.cpu_count() or 1)))


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--games", type=int, default=64)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["served", "inproc"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--on-ray", action="store_true", help="N > 1 as Ray actors too")
    args = parser.parse_args()
    settings: list[tuple[int, bool]] = [(n, False) for n in args.procs]
    ray_address = None
    if args.on_ray:
        from experiments.ray_session import connect, import_ray  # lazily: an optional extra

        connect("local")
        ray_address = import_ray().get_runtime_context().gcs_address
        settings += [(n, True) for n in args.procs if n > 1]
    from tests.support.fault_server import FaultPlan, FaultServer
    from tests.support.gpu_standin import text_policy

    server = FaultServer(FaultPlan(), answer=text_policy("random")).start()
    try:
        urls = {"served": server.url, "inproc": None}
        rates: dict[tuple[str, int, bool], list[float]] = {}
        busy: dict[tuple[str, int, bool], list[float]] = {}
        for _ in range(args.repeats):
            for mode in args.modes:
                for procs, on_ray in settings:
                    rate, steps, used = one_run(
                        args, procs, urls[mode], ray_address if on_ray else None
                    )
                    rates.setdefault((mode, procs, on_ray), []).append(rate)
                    busy.setdefault((mode, procs, on_ray), []).append(used)
                    print(
                        f"  {mode}, {procs} process(es){' on Ray' * on_ray}: {steps} steps, "
                        f"{rate:.0f}/s, cores {100 * used:.0f}% busy",
                        flush=True,
                    )
        print(
            f"\nsteps a second, first step to last, medians of {args.repeats} ({args.games} games,"
            f" --concurrency {args.concurrency}, --workers {args.workers}; {os.cpu_count()} cores):"
        )
        print(f"{'mode':<8} {'procs':>10} {'steps/s':>8} {'x one':>6} {'cores busy':>11}")
        for mode in args.modes:
            one = statistics.median(rates[(mode, *settings[0])])
            for procs, on_ray in settings:
                rate = statistics.median(rates[(mode, procs, on_ray)])
                used = statistics.median(busy[(mode, procs, on_ray)])
                name = f"{procs}{' on Ray' * on_ray}"
                print(f"{mode:<8} {name:>10} {rate:>8.0f} {rate / one:>6.2f} {100 * used:>10.0f}%")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
