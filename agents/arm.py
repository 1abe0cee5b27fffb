"""What an arm is: a name, the agent it builds, and the memory it keeps between trials.

An arm module (``agents/react.py``, ``agents/plan_execute.py``, ``agents/lats.py``) declares its
arms as :class:`Arm` records in a module-level ``ARMS`` tuple; :mod:`agents.arms` gathers them.
The runner builds an arm's agent through its record and never names an arm: adding one is a new
module under ``agents/`` and one line in :mod:`agents.arms` (or :func:`agents.arms.register`).
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
    config: Any  # the run's configuration (experiments.config.RunConfig): the arm's own section
    search_log: SearchLog | None = None  # where a search agent keeps its tree
    ground_truth: GroundTruth = NO_GROUND_TRUTH  # the games' solutions (LATS' oracle value only)


@dataclass(frozen=True)
class Arm:
    """One agent design: its name (``--agent``), its factory, and its memory between trials."""

    name: str
    build: Callable[[ArmContext], Agent]
    memory: MemoryPolicy
    code_protocol: bool = False  # the reflexion-code protocol plays it (the paper code's arms)
    ends: tuple[EndClass, ...] = ACTOR_ENDS  # how its episodes can end unwon (reports count these)
