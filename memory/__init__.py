"""Typed records of episodes and reflections, and the per-task sliding-window memory.

Standard library only: every other package may import this one.
"""

from memory.records import (
    EpisodeStatus,
    ExplorationFact,
    FailureClass,
    ModelCall,
    Reflection,
    Step,
    StepKind,
)
from memory.window import TaskMemory

__all__ = [
    "EpisodeStatus",
    "ExplorationFact",
    "FailureClass",
    "ModelCall",
    "Reflection",
    "Step",
    "StepKind",
    "TaskMemory",
]
