"""The registry of arms: every ``--agent`` choice and how it is built.

The built-in arm modules are listed once, below; each declares its :class:`~agents.arm.Arm`
records in ``ARMS``. A new arm is a new module under ``agents/`` and one entry in
``_MODULES`` (or, from outside the package, :func:`register`). Registering an arm declares its
config section (:mod:`agents.options`), so its options are run flags and YAML keys from then on.
"""

from __future__ import annotations

from agents import expel, insights, lats, options, plan_execute, react, retrieval
from agents.arm import RUN_ROLES, Arm
from agents.evaluators import ACTOR_ENDS
from memory.records import EndClass

_MODULES = (
    react,
    plan_execute,
    lats,
    insights,
    retrieval,
    expel,
)  # the order of the --agent choices
_ARMS: dict[str, Arm] = {}


def register(arm: Arm) -> Arm:
    """Add ``arm`` (its name must be new, its section's keys too unless it shares an arm's
    section); returns it."""
    if arm.name in _ARMS:
        raise ValueError(f"arm {arm.name!r} is already registered")
    for role in arm.roles:
        if role.name in RUN_ROLES:
            raise ValueError(f"arm {arm.name!r}: {role.name!r} is a role every run has already")
    if arm.section is not None and arm.settings is not None:
        options.declare(arm.section, arm.settings)
    _ARMS[arm.name] = arm
    return arm


def unregister(name: str) -> None:
    """Remove the arm ``name`` (a plug-in's, when it is done), and its section when no other arm
    shares it."""
    arm = _ARMS.pop(name, None)
    if arm is not None and arm.section is not None and arm.section not in sections():
        options.withdraw(arm.section)


def sections() -> dict[str, type]:
    """The registered arms' config sections, by key, in registration order."""
    return {a.section: a.settings for a in _ARMS.values() if a.section and a.settings}


def role_names() -> tuple[str, ...]:
    """The model roles the registered arms declare, each once, in registration order."""
    return tuple(dict.fromkeys(r.name for a in _ARMS.values() for r in a.roles))


def names() -> tuple[str, ...]:
    """Every arm's name, in registration order."""
    return tuple(_ARMS)


def described() -> str:
    """``--agent``'s help: every arm and what it is, from the registry."""
    parts = [f"{a.name} ({a.summary})" if a.summary else a.name for a in _ARMS.values()]
    return "arm: " + ", ".join(parts)


def find(name: str) -> Arm | None:
    return _ARMS.get(name)


def ends(name: str) -> tuple[EndClass, ...]:
    """How the arm's episodes can end unwon (an arm not registered here: an actor's ends)."""
    arm = _ARMS.get(name)
    return arm.ends if arm is not None else ACTOR_ENDS


def get(name: str) -> Arm:
    arm = _ARMS.get(name)
    if arm is None:
        raise ValueError(f"unknown arm {name!r}: use one of {', '.join(_ARMS)}")
    return arm


for _module in _MODULES:
    for _arm in _module.ARMS:
        register(_arm)
