"""Per-task memory: every reflection kept, the last ``size`` shown to the actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from memory.records import ExplorationFact, Reflection


@dataclass
class TaskMemory:
    """All reflections and exploration facts of one task; a sliding window of the last Ω."""

    task: str
    size: int = 3
    reflections: list[Reflection] = field(default_factory=list)
    facts: dict[str, ExplorationFact] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"memory size must be >= 0, got {self.size}")

    def add(self, reflection: Reflection) -> None:
        if reflection.task != self.task:
            raise ValueError(f"reflection for {reflection.task!r} added to memory of {self.task!r}")
        self.reflections.append(reflection)

    def visible(self) -> list[Reflection]:
        """The reflections the actor's prompt shows: the last ``size``."""
        if self.size == 0:
            return []
        return self.reflections[-self.size :]

    def observe(self, fact: ExplorationFact) -> None:
        """Record what a place held; a later observation of the same place replaces it."""
        self.facts[fact.place] = fact

    def known_places(self) -> list[ExplorationFact]:
        return [self.facts[k] for k in sorted(self.facts)]
