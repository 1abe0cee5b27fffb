"""Config options, declared where they are read: the :func:`option` leaf and the table of sections.

A section is a frozen dataclass whose fields are all :func:`option` leaves. The run configuration
(``experiments.config``) declares its own sections here and an arm module declares its section
with its arms (:class:`agents.arm.Arm`); from the sections come the ``run`` flags, ``--help`` and
the YAML keys. A leaf's name is its key everywhere (flat YAML keys, flags, the manifest), so leaf
names are unique across all sections: :func:`declare` refuses a clash.

This module imports no agent and nothing of ``experiments``: both import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

from agents.llm.specs import parse_spec


def option(
    default: Any,
    help: str | Callable[[], str],
    *,
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    check: Callable[[Any], object] | None = None,
    resumable: bool = False,
    flag: str | None = None,
) -> Any:
    """A config leaf: its default, its docstring (the ``--help`` text), and its rules.

    ``minimum``/``maximum`` bound a number (inclusive), ``above`` excludes its bound (``top_p``
    must be > 0); ``check`` parses the value the way the run will (a model spec, a deadline) and
    raises ``ValueError`` naming the fix. A float is never NaN or infinite (None means "no
    limit"). ``resumable``: the key may change on ``--resume``; ``flag``: the flag when it is not
    ``--`` plus the name. A callable ``help`` is read when the help is shown (``--agent``'s
    lists the arms registered by then)."""
    meta: dict[str, Any] = {"help": help, "choices": choices, "resumable": resumable}
    meta.update(flag=flag, minimum=minimum, maximum=maximum, above=above, check=check)
    if isinstance(default, dict | list | tuple):
        frozen = default
        return field(default_factory=lambda: type(frozen)(frozen), metadata=meta)
    return field(default=default, metadata=meta)


def help_text(meta: Any) -> str:
    """An option's help text (see :func:`option`)."""
    text = meta["help"]
    return str(text() if callable(text) else text)


def model_spec(value: str) -> None:
    """An option's check: a model spec (a bad one is refused before a run directory is touched)."""
    parse_spec(value)


def leaf_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


_SECTIONS: dict[str, type] = {}  # section key -> its dataclass, in declaration order
_OWNER: dict[str, str] = {}  # leaf name -> the key of its section


def declare(key: str, kind: type) -> None:
    """Add the section ``key`` (``kind``: a dataclass of :func:`option` leaves). Declaring the same
    section again does nothing; a key taken by another type, or a leaf name another section (or
    a section key) already has, is a ValueError naming both."""
    if _SECTIONS.get(key) is kind:
        return
    if key in _SECTIONS:
        raise ValueError(
            f"config section {key!r} is already {_SECTIONS[key].__name__}'s: give "
            f"{kind.__name__} another section key"
        )
    names = leaf_names(kind)
    taken = {n: _OWNER[n] for n in names if n in _OWNER}  # a leaf of another section
    taken.update({n: n for n in names if n in _SECTIONS})  # another section's key
    if _OWNER.get(key, key) != key:  # the key is another section's leaf
        taken[key] = _OWNER[key]
    if taken:
        name, owner = next(iter(taken.items()))
        raise ValueError(
            f"config key {name!r} of section {key!r} ({kind.__name__}) is already section "
            f"{owner!r}'s: config keys are unique across sections, rename it"
        )
    _SECTIONS[key] = kind
    _OWNER.update({n: key for n in names})


def withdraw(key: str) -> None:
    """Remove the section ``key`` (a plug-in arm's, when it is unregistered)."""
    kind = _SECTIONS.pop(key, None)
    if kind is not None:
        for name in leaf_names(kind):
            _OWNER.pop(name, None)


def sections() -> dict[str, type]:
    """Every declared section, by key, in declaration order."""
    return dict(_SECTIONS)
