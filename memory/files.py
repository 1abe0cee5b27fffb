"""Files a user keeps (exports, reports, config copies, a preset's state) and the env workers'
stored translations: whole or not at all.

:func:`atomic_write` writes into a temporary file in the target's folder, flushes it to the
disk and renames it over the target (``os.replace``): a reader, a crash or a ``kill -9`` finds
the previous file or the new one, never a part. On Linux the temporary has no name while it is
written (``O_TMPFILE``), so a process killed mid-way leaves nothing behind; it gets one,
``.<name>.<random>.tmp``, for the instant between being complete and the rename. Elsewhere (a
file system without ``O_TMPFILE``) it is named that way from the start. Any error inside the
block, Ctrl-C included, removes it and leaves the target as it was.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# O_TMPFILE's errors on a kernel or file system without it (open(2))
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
_PROC_FD = Path("/proc/self/fd")  # how an unnamed file is given a name without privileges


@contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "w", *, newline: str | None = None
) -> Iterator[IO[Any]]:
    """A file object to write ``path`` through: text (UTF-8) for ``mode="w"``, bytes for
    ``"wb"``; ``path`` is replaced when the block ends without an error. The folder must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', not {mode!r}")
    target = Path(path)
    fd, named = _temporary(target)
    try:
        if mode == "w":
            f: IO[Any] = os.fdopen(fd, mode, encoding="utf-8", newline=newline)
        else:
            f = os.fdopen(fd, mode)
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if named is None:
                named = _give_name(f.fileno(), target)
        try:
            os.replace(named, target)
        except OSError as exc:  # named after the file the user asked for, not the temporary
            raise type(exc)(exc.errno, exc.strerror, str(target)) from None
    except BaseException:
        if named is not None:
            named.unlink(missing_ok=True)
        raise
    _sync_folder(target.parent)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """``path`` replaced by ``text`` (UTF-8), whole or not at all."""
    with atomic_write(path) as f:
        f.write(text)


def _temporary(target: Path) -> tuple[int, Path | None]:
    """An open descriptor to write into, and its name (None while it has none)."""
    folder = target.parent
    if hasattr(os, "O_TMPFILE") and _PROC_FD.is_dir():
        try:
            return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666), None
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
    while True:
        name = _temporary_name(target)
        try:
            # 0o666: the umask applies, as it does to any file the user makes
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue


def _give_name(fd: int, target: Path) -> Path:
    """Link the unnamed file open as ``fd`` into ``target``'s folder under a temporary name."""
    folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while True:
            name = _temporary_name(target)
            try:
                # linkat(..., AT_SYMLINK_FOLLOW) as open(2) shows; a folder descriptor makes
                # Python call linkat rather than link, which would not follow the /proc link
                os.link(_PROC_FD / str(fd), name.name, dst_dir_fd=folder)
                return name
            except FileExistsError:
                continue
    finally:
        os.close(folder)


def _temporary_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every system opens folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
