"""Timing and arguments shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def data_parser(doc: str | None, root: Path) -> argparse.ArgumentParser:
    """A benchmark's parser with ``--data``: $ALFWORLD_DATA, else the shared games beside the
    checkout ``root``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    shared = root.parent / "shared" / "alfworld_data"
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("ALFWORLD_DATA", shared)))
    return parser


def child_result(cmd: list[str], root: Path) -> dict[str, Any]:
    """Run a benchmark's child (``cmd``, in ``root`` with ``root`` on its path) and return the
    JSON of the line it printed starting ``BENCH ``; a child that failed, or whose run exited
    non-zero (``code``), stops the benchmark with the end of its error output."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the runner failed ({done.returncode}): {done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(line[len("BENCH ") :])
    if out.get("code", 0) != 0:
        raise SystemExit(f"the runner exited {out['code']}: {done.stderr[-3000:]}")
    return out


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (every core; Linux)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
