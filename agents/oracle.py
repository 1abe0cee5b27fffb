"""The ``oracle`` value of the tree search: privileged, for upper-bound experiments and
model-free tests, never a default. It reads the game's walkthrough (a plan from the initial state)
through the ground-truth port, :mod:`agents.llm.ground_truth`, and nothing else does on the agent
side.

The distance to the goal: walking the path, successful actions that match the next walkthrough
action advance along it; moves, looks, examines, and opening or closing receptacles the rest of
the walkthrough does not use change nothing; any other successful action leaves the set of states
the walkthrough still solves (value 0). The distance is the walkthrough's remaining length, plus
one ``go to`` when the agent is not where the next walkthrough action must happen; a distance
beyond the remaining step budget scores 0. Success is predicted from the admissible commands,
which is exact for ALFWorld's engine. Without a walkthrough every candidate scores 0.5.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.parsing import RECEPTACLE_VERBS, STILL_VERBS, verb_target
from agents.react import NOTHING_HAPPENS
from memory.records import StepKind

if TYPE_CHECKING:
    from agents.episode import ModelPort
    from agents.values import Candidate, NodeView

log = logging.getLogger("agents.oracle")


@dataclass(frozen=True)
class Oracle:
    ground_truth: GroundTruth = NO_GROUND_TRUTH
    name: str = "oracle"

    async def score(
        self, model: ModelPort, node: NodeView, candidates: Sequence[Candidate]
    ) -> list[float]:
        walkthrough = self.ground_truth.walkthrough(node.game)
        if not walkthrough:
            log.warning("oracle value: game %s has no walkthrough; every candidate scores 0.5",
                        node.game)  # fmt: skip
            return [0.5 for _ in candidates]
        wt = [str(a) for a in walkthrough]
        path = [
            (s.action, s.observation != NOTHING_HAPPENS)
            for s in node.steps
            if s.kind == StepKind.ACT
        ]
        depth = len(node.steps) + 1
        out = []
        for c in candidates:
            acts = path
            if c.kind == StepKind.ACT:
                acts = [*path, (c.action, c.action in node.state.admissible)]
            distance = oracle_distance(wt, acts)
            if distance is None or distance > node.max_steps - depth:
                out.append(0.0)
            else:
                out.append(1.0 - distance / (len(wt) + 1))
        return out


def oracle_distance(walkthrough: Sequence[str], path: Sequence[tuple[str, bool]]) -> int | None:
    """Actions from the end of ``path`` (``(action, succeeded)`` pairs) to the goal, along the
    walkthrough; None when the path left the states the walkthrough solves (module docstring)."""
    j = 0
    location: str | None = None
    for action, succeeded in path:
        if not succeeded:
            continue  # "Nothing happens.": no change
        verb, target = verb_target(action)
        if j < len(walkthrough) and action == walkthrough[j]:
            j += 1
        elif verb in STILL_VERBS:
            continue
        elif verb in RECEPTACLE_VERBS and not any(target in w for w in walkthrough[j:]):
            continue
        elif verb != "go":
            return None
        if verb == "go":
            location = target
    if j == len(walkthrough):
        return 0
    repair = 0
    if verb_target(walkthrough[j])[0] != "go":
        needed = next((verb_target(w)[1] for w in reversed(walkthrough[:j]) if verb_target(w)[0] == "go"),
                      None)  # fmt: skip
        repair = int(needed is not None and needed != location)
    return len(walkthrough) - j + repair
