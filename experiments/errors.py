"""Errors of the experiment layer; the CLI turns each into one line and exit code 2."""


class ConfigError(ValueError):
    """A bad flag, config key or value; the message names the fix."""


class RunStoreError(RuntimeError):
    """A run directory that cannot be used (missing, mismatched manifest, locked)."""
