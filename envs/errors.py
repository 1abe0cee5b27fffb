"""Errors the envs raise for bad input: one clear line naming the problem and the fix."""


class EnvError(ValueError):
    """Bad data dir, split, game id, or game file."""


class GameFileError(EnvError):
    """A game file that cannot be read or loaded."""
