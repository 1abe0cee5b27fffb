"""Run the ``reflexsim`` command line and stop the process (SIGSTOP) the moment a file it is
writing in FOLDER holds bytes, so that a test can ``kill -9`` it mid-write at a known point
instead of racing it with a timer::

    python -m tests.support.stop_mid_write FOLDER export RUN_DIR --format jsonl ...

A file "it is writing in FOLDER" is any file open in this process whose path (or, for an
unnamed ``O_TMPFILE`` file, the folder ``/proc`` names) is in FOLDER; the check runs between
Python calls, in the thread that writes, so the stop comes while the rest is still to write.
Linux only (it reads ``/proc/self/fd``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

CHECK_EVERY = 50  # profile events between two looks at /proc/self/fd


def writing_in(folder: Path) -> bool:
    """Whether a file open in this process lies in ``folder`` and holds bytes."""
    for fd in os.listdir("/proc/self/fd"):
        link = f"/proc/self/fd/{fd}"
        try:
            where = Path(os.readlink(link).removesuffix(" (deleted)"))
            if where.parent == folder and os.stat(link).st_size > 0:
                return True
        except OSError:
            continue
    return False


def main(argv: list[str]) -> int:
    folder = Path(argv[0]).resolve()
    events = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        events += 1
        if events % CHECK_EVERY == 0 and writing_in(folder):
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGSTOP)

    from experiments.cli import main as cli

    sys.setprofile(hook)
    return cli(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
