"""Text spaces shared by the envs: printable charset, empty strings allowed."""

from __future__ import annotations

import string

from gymnasium import spaces

CHARSET = frozenset(string.printable)
MAX_OBSERVATION = 65536
MAX_ACTION = 4096


def text_space(max_length: int) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=string.printable)


def printable(text: str, limit: int = MAX_OBSERVATION) -> str:
    """Make an observation fit the space: non-printable characters become '?'."""
    if all(c in CHARSET for c in text):
        return text[:limit]
    return "".join(c if c in CHARSET else "?" for c in text)[:limit]
