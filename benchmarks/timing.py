"""Timing and arguments shared by the benchmarks."""

from __future__ import annotations

import argparse
import os
import statistics
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
