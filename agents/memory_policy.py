"""Memory between trials: what an arm shows the actor of a task's earlier trials, and what it
keeps of a failed one. Each arm names its policy (:class:`agents.arm.Arm`); the trial loop asks
it and never tests an arm's name.

- :data:`NO_MEMORY`: nothing (``react``, ``plan``, ``lats``: trials are independent samples).
- :data:`REFLEXION`: a self-reflection on each failed trial; the last Ω are shown.
- :data:`EXPLORATION`: as :data:`REFLEXION`, plus what earlier trials saw in each place.
- :data:`EPISODIC`: the failed trajectory itself, trimmed (``epm``: no model call); the last Ω
  are shown.

Policies that also show experience of other games (``PastTrials.experience``) live with their
arms: :mod:`agents.insights` (rules above the prompt), :mod:`agents.retrieval` (retrieved
examples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agents import reflexion_code as code
from agents.episode import ModelPort
from agents.experience import Experience, Retrieved, Rule
from agents.reflexion import (
    Reflected,
    ReflexionSettings,
    episodic_memory,
    exploration_facts,
    reflect,
    visible_reflections,
)
from memory.records import ExplorationFact, Reflection, Step


@dataclass(frozen=True)
class Recall:
    """What the actor is shown of a task's earlier trials."""

    reflections: tuple[Reflection, ...] = ()
    facts: tuple[ExplorationFact, ...] = ()
    rules: tuple[Rule, ...] = ()  # shown at the top of the prompt (learned on other tasks)
    # the won attempts of other tasks shown in place of the few-shot examples, from the
    # episode's first observation (its task), when the policy retrieves them
    retrieved_for: Callable[[str], tuple[Retrieved, ...]] | None = None


@dataclass(frozen=True)
class Failed:
    """A failed episode a policy may keep something of."""

    task: str
    trial: int
    episode_id: str
    observation: str
    steps: Sequence[Step]


class PastTrials(Protocol):
    """A task's earlier trials, as the trial loop reads them from the run store, and the
    experience of other tasks the run was given (:mod:`agents.experience`)."""

    task_type: str
    experience: Experience | None

    def reflections(self) -> list[Reflection]:
        """The task's memory items, every trial's."""
        ...

    def steps_before(self, trial: int) -> list[tuple[int, list[Step]]]:
        """``(trial, steps)`` of the task's episodes before ``trial``, oldest first."""
        ...

    async def trial_summary(self, trial: int) -> code.TrialSummary | None:
        """The reflexion-code protocol's trial counts, for the run's last game (else None)."""
        ...


class MemoryPolicy(Protocol):
    """How an arm remembers between trials."""

    @property
    def reflects(self) -> bool:
        """Whether each failed trial but the last costs a reflector call (dry-run estimates)."""
        ...

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall: ...

    async def remember(
        self, model: ModelPort, settings: ReflexionSettings, past: PastTrials, failed: Failed
    ) -> Reflected | None:
        """The memory item of ``failed`` (None: nothing is kept). Raises the backend's error."""
        ...


class NoMemory:
    reflects = False

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        return Recall()

    async def remember(
        self, model: ModelPort, settings: ReflexionSettings, past: PastTrials, failed: Failed
    ) -> Reflected | None:
        return None


class _Window:
    """The last Ω memory items of the task (``memory_size``) are shown."""

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        shown = visible_reflections(past.reflections(), task, trial, settings.memory_size)
        return Recall(tuple(shown))


class ReflexionWindow(_Window):
    reflects = True

    async def remember(
        self, model: ModelPort, settings: ReflexionSettings, past: PastTrials, failed: Failed
    ) -> Reflected | None:
        earlier: list[Reflection] = []
        summary = None
        if settings.layout.reads_trial_summary:
            earlier = visible_reflections(
                past.reflections(), failed.task, failed.trial, settings.memory_size
            )
            summary = await past.trial_summary(failed.trial)
        return await reflect(
            model,
            settings,
            task=failed.task,
            trial=failed.trial,
            episode_id=failed.episode_id,
            observation=failed.observation,
            steps=failed.steps,
            past=earlier,
            summary=summary,
        )


class Exploration(ReflexionWindow):
    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        shown = super().recall(settings, past, task, trial)
        facts = exploration_facts(past.steps_before(trial), task)
        return Recall(shown.reflections, tuple(facts))


class Episodic(_Window):
    reflects = False

    async def remember(
        self, model: ModelPort, settings: ReflexionSettings, past: PastTrials, failed: Failed
    ) -> Reflected | None:
        item, note = episodic_memory(
            settings,
            task=failed.task,
            trial=failed.trial,
            episode_id=failed.episode_id,
            steps=failed.steps,
        )
        return Reflected(item, 0, 0, note)


NO_MEMORY = NoMemory()
REFLEXION = ReflexionWindow()
EXPLORATION = Exploration()
EPISODIC = Episodic()
