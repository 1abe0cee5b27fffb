"""What a model server or engine sends back is untrusted: the checks an answer passes where it
enters the process, once, for every backend. Past them the harness trusts the types.

- **Text** (:func:`storable`): a lone UTF-16 surrogate (JSON ``"\\ud800"``) has no UTF-8 form,
  so SQLite, a file or a terminal would fail on it. :class:`~agents.llm.base.Completion` passes
  its text through here when it is made: each such code point becomes U+FFFD and is counted
  (``Completion.invalid_text``; the engine records an ``invalid_text`` event). Control
  characters are kept as sent: they are stored as they are and shown escaped.
- **Numbers** (:func:`count`): token counts are finite, non-negative whole numbers. A negative,
  fractional, infinite or NaN one, a boolean or a numeric string makes the whole answer a
  :class:`MalformedResponse`: a server fault, retried as a 5xx is, then the request's
  :class:`~agents.llm.base.BackendError`. A count the server leaves out is 0.
- **Shapes**: the HTTP backends read a 200 answer through their ``_parse``, which raises
  :class:`MalformedResponse` for anything but the fields they need (no choices, a choice
  without text, a body that is not JSON); a body cut mid-way is a dropped connection.
- **Numbers a model writes** (:func:`small_number`): digits in model text become an int only
  when they are few (Python refuses to convert more than 4,300 digits, and no rule or rating
  has a ten-digit number).
"""

from __future__ import annotations

import math
import re
from typing import Any

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_DIGITS = 9  # the longest number read from model text


class MalformedResponse(Exception):
    """The server answered 200 with something that is not the expected answer (a body that is
    not JSON, a missing field, an impossible number): a server fault, retried."""


def storable(text: str) -> tuple[str, int]:
    """``text`` with every code point that has no UTF-8 form (a lone surrogate: the only kind
    a Python string can hold) replaced by U+FFFD, and how many were replaced."""
    if text.isascii():
        return text, 0
    return _SURROGATE.subn(REPLACEMENT, text)


def storable_data(value: Any) -> Any:
    """JSON-like ``value`` with every string in it made :func:`storable` (JSON can write a lone
    surrogate as ``"\\ud800"``, so a stored JSON value may hold one)."""
    if isinstance(value, str):
        return storable(value)[0]
    if isinstance(value, list):
        return [storable_data(v) for v in value]
    if isinstance(value, dict):
        return {storable(str(k))[0]: storable_data(v) for k, v in value.items()}
    return value


def json_object(value: Any, name: str) -> dict[str, Any]:
    """``value`` (a part of an answer's JSON) when it is an object, ``{}`` for a missing one
    (None); anything else is a :class:`MalformedResponse` naming ``name``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedResponse(f"{name} is not an object ({type(value).__name__})")
    return value


def count(value: Any, name: str) -> int:
    """A token count from a server's answer: a finite, non-negative whole number (None: 0);
    anything else is a :class:`MalformedResponse` naming ``name``."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponse(f"{name} is not a number ({type(value).__name__})")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise MalformedResponse(f"{name} is not a whole number ({value!r})")
    if value < 0:
        raise MalformedResponse(f"{name} is negative ({value!r})")
    return int(value)


def small_number(digits: str) -> int | None:
    """The int that ``digits`` (a run of decimal digits in model text) writes, or None when it
    has more than :data:`MAX_DIGITS` of them (no rule number or rating is that long)."""
    return int(digits) if len(digits) <= MAX_DIGITS else None
