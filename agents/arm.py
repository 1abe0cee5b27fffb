"""What an arm is: a name, the agent it builds, and the memory it keeps between trials.

An arm module (``agents/react.py``, ``agents/plan_execute.py``, ``agents/lats.py``) declares its
arms as :class:`Arm` records in a module-level ``ARMS`` tuple; :mod:`agents.arms` gathers them.
An arm with options of its own declares them as its config section: a frozen dataclass of
:func:`agents.options.option` leaves, named by the record (``section``, ``settings``). The run
configuration takes the section from the registry (its flags, YAML keys and ``--help``), and the
arm's factory gets the section's values as its settings, field for field.
An arm that calls models besides the actor declares them as :class:`ModelRole` records (a role's
name, the request purposes it answers, the key of the arm's section that names its model): the
run builds a backend for each role whose model is set and sends those purposes to it.
The runner builds an arm's agent through its record and never names an arm or its roles: adding
one is a new module under ``agents/`` and one line in :mod:`agents.arms` (or
:func:`agents.arms.register`). How its prompts are laid out is its actor's layout's
(:mod:`agents.layout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agents.evaluators import ACTOR_ENDS
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from memory.records import EndClass, SearchEnd, SearchIteration, SearchNode, SearchTree

if TYPE_CHECKING:  # types only: the arm modules import this one
    from agents.episode import Agent
    from agents.memory_policy import MemoryPolicy
    from agents.react import ActorSettings
    from agents.reflexion import ReflexionSettings


class SearchLog(Protocol):
    """Where a search tree is kept (the run store); see :mod:`agents.lats`."""

    def search_tree(self, episode: str) -> SearchTree | None: ...

    def save_search(
        self, episode: str, nodes: Sequence[SearchNode], iteration: SearchIteration | None = None
    ) -> None: ...

    def end_search(self, episode: str, end: SearchEnd, chosen: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class ArmContext:
    """What an arm's factory builds its agent from."""

    actor: ActorSettings  # how the actor is asked and its steps judged
    reflexion: ReflexionSettings  # how a failed attempt is reflected on
    settings: Any = None  # the arm's own config section (an ``Arm.settings`` instance), if any
    search_log: SearchLog | None = None  # where a search agent keeps its tree
    ground_truth: GroundTruth = NO_GROUND_TRUTH  # the games' solutions (LATS' oracle value only)


# The roles every run has: the actor, the reflector (reflect and judge calls) and the model a
# failed task may be escalated to. An arm's own roles come beside them.
RUN_ROLES = ("actor", "reflect", "escalate")


@dataclass(frozen=True)
class ModelRole:
    """A model an arm calls besides the actor: its name (``--role-option NAME.KEY=VALUE`` sets
    its backend's options), the purposes of the requests it answers, and the key of the arm's
    config section that names its model spec (unset: the actor's model answers)."""

    name: str
    purposes: tuple[str, ...]
    key: str


@dataclass(frozen=True)
class Arm:
    """One agent design: its name (``--agent``), its factory, its memory between trials, and its
    config section (``section``: its key, as in YAML ``planning: {...}``; ``settings``: its
    dataclass of options; arms may share one)."""

    name: str
    build: Callable[[ArmContext], Agent]
    memory: MemoryPolicy
    summary: str = ""  # what ``--agent``'s help says of it: a few words
    code_protocol: bool = False  # the reflexion-code protocol plays it (the paper code's arms)
    section: str | None = None
    settings: type | None = None
    ends: tuple[EndClass, ...] = ACTOR_ENDS  # how its episodes can end unwon (reports count these)
    roles: tuple[ModelRole, ...] = ()  # the models it calls besides the actor

    def __post_init__(self) -> None:
        if (self.section is None) != (self.settings is None):
            raise ValueError(f"arm {self.name!r}: a config section needs its key and its type")
        fields = set(getattr(self.settings, "__dataclass_fields__", {}))
        for role in self.roles:
            if role.key not in fields:
                raise ValueError(
                    f"arm {self.name!r}: role {role.name!r} names its model by {role.key!r}, "
                    "which is not a key of the arm's config section"
                )
