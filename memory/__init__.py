"""Typed records of episodes and reflections, the per-task sliding-window memory, and files
written whole or not at all (:mod:`memory.files`).

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
