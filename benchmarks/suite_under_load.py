"""The test suite's wall time, quiet and with CPU-bound processes beside it, and what failed.

A test that passes only on an idle machine is a test that fails in CI some day. This runs a
pytest command (by default the README's test line, without the install) ``--repeats`` times with
``--load`` busy processes beside it (pure-Python loops, one core each), and prints each run's
wall time, its pytest summary line and the node ids of the tests that failed; with ``--load 0``
it is the quiet time. Every run's log is kept under ``--logs``.

On a Linux kernel that groups processes by session (``/proc/sys/kernel/sched_autogroup_enabled``
is 1), ``nice`` does not keep other work out of the way: every terminal or job session gets an
equal share of the CPU whatever its nice value, so work started elsewhere at ``nice -n 19`` still
loads the measurement as much as the busy processes do. Measure with nothing else running, or
with autogrouping off (as root: ``echo 0 > /proc/sys/kernel/sched_autogroup_enabled``).

Run from the checkout to measure, e.g.:

    python benchmarks/suite_under_load.py --load 2 --repeats 3
    python benchmarks/suite_under_load.py --load 0 -- -m slow
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=+ (.*(passed|failed|error).*) =+$")
FAILED = re.compile(r"^(FAILED|ERROR) (\S+)")


def _spin() -> None:  # pragma: no cover - a load, never returns
    x = 0
    while True:
        x = (x * 31 + 7) % 1_000_003


def run_once(pytest_args: list[str], load: int, log: Path) -> tuple[float, str, list[str], int]:
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(load)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        with log.open("w") as out:
            code = subprocess.call(
                [sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
    finally:
        for hog in hogs:
            hog.kill()
    wall = time.monotonic() - started
    lines = log.read_text(errors="replace").splitlines()
    summary = next((m.group(1) for line in reversed(lines) if (m := SUMMARY.match(line))), "?")
    failed = [m.group(2) for line in lines if (m := FAILED.match(line))]
    return wall, summary, failed, code


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the suite")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--logs", type=Path, default=Path("suite-logs"))
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    worst = 0
    for i in range(args.repeats):
        log = args.logs / f"load{args.load}-{i}.log"
        wall, summary, failed, code = run_once(args.pytest_args, args.load, log)
        worst = max(worst, code)
        print(f"run {i + 1}/{args.repeats} load {args.load}: {wall / 60:.1f} min  {summary}")
        for node in failed:
            print(f"    failed: {node}")
        sys.stdout.flush()
    return worst


if __name__ == "__main__":
    sys.exit(main())
