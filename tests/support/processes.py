"""Waiting for a process to be gone, instead of sleeping and hoping a loaded machine was quick."""

from __future__ import annotations

import time
from pathlib import Path


def dead(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie its parent has not reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")  # the state follows the name


def wait_dead(pid: int, guard_s: float = 120.0) -> None:
    """Return once ``pid`` has exited; ``guard_s`` only tells a hang from a slow machine."""
    deadline = time.monotonic() + guard_s
    while not dead(pid):
        assert time.monotonic() < deadline, f"process {pid} still alive after {guard_s} s"
        time.sleep(0.01)
