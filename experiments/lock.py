"""One writer per directory: an OS lock (``flock``) on a file inside it, held for as long as the
writer lives and released by the kernel when its process ends, ``kill -9`` included.

The lock file holds the holder's pid and host, so the error a second writer gets names it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from experiments.errors import RunStoreError


class DirLock:
    """An exclusive lock on ``directory / name``; :meth:`acquire` takes it, :meth:`release` (or
    the end of the process) lets it go."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = Path(directory) / name
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait_s: float = 0.0, what: str = "a run") -> DirLock:
        """Take the lock, waiting up to ``wait_s`` for another holder to go; a RunStoreError
        naming the live holder when it does not. Creates the directory if needed."""
        if self._fd is not None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunStoreError(
                f"cannot lock {str(self.path.parent)!r} ({exc.strerror or exc}): {what} writes "
                "there: use a folder you can write to (a copy of it, for a read-only one)"
            ) from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder(fd)
                    os.close(fd)
                    raise RunStoreError(
                        f"{str(self.path.parent)!r} is in use by {what} ({holder}): wait for "
                        "it to end or stop it, then try again"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self._fd = fd
        return self

    def refuse_if_held(self, what: str = "a run") -> None:
        """A RunStoreError naming the live holder when another process holds the lock now;
        nothing is created or written (the directory may not exist yet)."""
        if holder_alive(self.path.parent, self.path.name):
            self.acquire(what=what).release()  # held: raises, naming the holder

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        who = json.loads(raw.decode() or "{}")
        return f"pid {int(who['pid'])} on {str(who['host'])[:80]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def holder_alive(directory: Path, name: str) -> bool:
    """Whether some process holds the lock of ``directory / name`` now (never waits)."""
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
