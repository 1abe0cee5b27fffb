"""Heuristic evaluators: decide, step by step, that an episode has failed.

``paper`` (default, Shinn et al. 2023): fail when the same action received the same observation
more than 3 cycles in a row, or after more than 30 actions. ``code`` (the original code): fail when
the same action string is emitted twice in a row. Success always means the env's ``won``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from memory.records import EndClass, FailureClass, Step, StepKind


@dataclass(frozen=True)
class Verdict:
    failed: bool
    reason: str
    failure_class: str | None = None


class Evaluator(Protocol):
    @property
    def name(self) -> str: ...

    def check(self, steps: Sequence[Step]) -> Verdict | None:
        """A failure verdict that ends the episode now, or None to go on."""
        ...


def count_actions(steps: Sequence[Step], count_thoughts: bool) -> int:
    return sum(1 for s in steps if count_thoughts or s.kind != StepKind.THINK)


@dataclass(frozen=True)
class PaperEvaluator:
    max_repeats: int = 3  # fail when a repeat run is longer than this
    max_actions: int = 30  # fail when more actions than this were taken
    count_thoughts: bool = True
    name: str = "paper"

    def check(self, steps: Sequence[Step]) -> Verdict | None:
        if not steps:
            return None
        last = steps[-1]
        run = 0
        for s in reversed(steps):
            if s.action == last.action and s.observation == last.observation:
                run += 1
            else:
                break
        if run > self.max_repeats:
            return Verdict(
                True,
                f"the same action got the same observation {run} times in a row: {last.action!r}",
                FailureClass.REPEATED_ACTION.value,
            )
        n = count_actions(steps, self.count_thoughts)
        if n > self.max_actions:
            return Verdict(
                True, f"more than {self.max_actions} actions ({n})", FailureClass.TOO_LONG.value
            )
        return None


@dataclass(frozen=True)
class CodeEvaluator:
    name: str = "code"
    # the reflexion-code protocol: the exact action strings, the first compared with "" (the
    # code's EnvironmentHistory starts with an empty last action)
    exact: bool = False

    def check(self, steps: Sequence[Step]) -> Verdict | None:
        if self.exact:
            repeated = bool(steps) and steps[-1].action == (
                steps[-2].action if len(steps) >= 2 else ""
            )
        else:
            repeated = len(steps) >= 2 and _key(steps[-1]) == _key(steps[-2])
        if repeated:
            return Verdict(
                True,
                f"the same action was emitted twice in a row: {steps[-1].action!r}",
                FailureClass.REPEATED_ACTION.value,
            )
        return None


def _key(step: Step) -> str:
    return step.action or step.raw_output.strip()


@dataclass(frozen=True)
class NoEvaluator:
    """The LLM-judge arm: no heuristic stop; the judge reads the finished trajectory."""

    name: str = "llm"

    def check(self, steps: Sequence[Step]) -> Verdict | None:
        return None


def make_evaluator(
    name: str,
    count_thoughts: bool = True,
    max_actions: int = 30,
    max_repeats: int = 3,
    exact: bool = False,
) -> Evaluator:
    """An evaluator by name; the paper's limits are its own settings, independent of the step
    cap (``--max-steps 50`` runs past 31 actions only with ``max_actions`` >= 50)."""
    if name == "paper":
        return PaperEvaluator(
            max_repeats=max_repeats, max_actions=max_actions, count_thoughts=count_thoughts
        )
    if name == "code":
        return CodeEvaluator(exact=exact)
    if name == "llm":
        return NoEvaluator()
    raise ValueError(f"unknown evaluator {name!r}: use paper, code or llm")


# How an actor's episodes end unwon (the classes classify_failure gives), in the reports' order.
ACTOR_ENDS = tuple(
    EndClass(c)
    for c in (
        FailureClass.REPEATED_ACTION,
        FailureClass.TOO_LONG,
        FailureClass.STEP_CAP,
        FailureClass.INVALID_ACTIONS,
        FailureClass.OTHER,
    )
)


def classify_failure(steps: Sequence[Step], verdict: Verdict | None, truncated: bool) -> str:
    """The failure class of an episode that was not won."""
    acts = [s for s in steps if s.kind != StepKind.THINK]
    bad = sum(1 for s in acts if s.kind == StepKind.INVALID or not s.admissible)
    if acts and bad / len(acts) > 0.5:
        return FailureClass.INVALID_ACTIONS.value
    if verdict is not None and verdict.failure_class:
        return verdict.failure_class
    if truncated:
        return FailureClass.STEP_CAP.value
    return FailureClass.OTHER.value
