"""Errors of the experiment layer; the CLI turns each into one line and exit code 2 (or 3)."""

import errno


class ConfigError(ValueError):
    """A bad flag, config key or value; the message names the fix."""


class RunStoreError(RuntimeError):
    """A run directory that cannot be used (missing, mismatched manifest, locked)."""


class StoreFullError(RunStoreError):
    """The disk holding a run store is full: what was recorded is kept; resume after freeing."""


class StoreDamagedError(RunStoreError):
    """A run store's file is damaged (garbage inside, truncated): the message says what still
    reads and how to recover it."""


class InfraError(RuntimeError):
    """A model server kept failing (after its retries) outside an episode, in rule extraction:
    nothing was kept or played, and the same command run again retries it. The CLI prints one
    line and exits 3, as for a run that ended with infrastructure errors."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``): handled like Ctrl-C, with its own exit code."""

    exit_code = 143


def is_disk_full(exc: BaseException) -> bool:
    """An OSError of a full disk or quota (the CLI says so in one line; free space, run again)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
