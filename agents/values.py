"""Value functions of the tree search: how promising each candidate next action is, in [0, 1].

Each scores the candidates of one expansion from the node's state (its path so far and the
env's last reply) before any of them is executed: the search executes a child only when it
selects it, because restoring a node costs a reset and a replay of its path.

- ``llm``: the model's self-evaluation, 1-10, of the path and the proposed action (one
  ``purpose="value"`` request per candidate; unparseable answers score 0.5).
- ``sc``: self-consistency: the share of the expansion's samples that proposed the action.
- ``heuristic``: no model. Unparseable output and commands that are not admissible (the game
  answers them "Nothing happens.") are penalised, as are actions the path already took;
  actions that can reveal new facts (going somewhere not yet visited, opening something not yet
  opened) are rewarded.
- ``oracle``: privileged, for upper-bound experiments and model-free tests, never a default:
  the distance to the goal along the game's ground truth (:mod:`agents.oracle`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from agents.episode import ModelPort
from agents.llm.answers import small_number
from agents.llm.base import CallSite, GenerationConfig, Request
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.oracle import Oracle
from agents.parsing import STILL_VERBS, verb_target
from agents.prompting import render_transcript, template, transcript_pairs
from memory.records import EnvReply, Step, StepKind

VALUES = ("llm", "sc", "heuristic", "oracle")
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class Candidate:
    """One distinct next action of an expansion (duplicates merged after parsing)."""

    kind: str  # a StepKind value
    action: str  # what would be executed ("" for unparseable output)
    raw: str  # the first sample's text
    samples: int = 1  # how many samples proposed it


@dataclass(frozen=True)
class NodeView:
    """What a value function sees of the node being expanded."""

    observation: str  # the episode's first observation
    steps: tuple[Step, ...]  # the path from the root
    state: EnvReply  # the env's reply at the node (admissible commands, info)
    max_steps: int
    game: str = ""
    trial: int = 0
    seed: int | None = 0
    site: CallSite = field(default_factory=CallSite)  # the expansion request's


class ValueFunction(Protocol):
    @property
    def name(self) -> str: ...

    async def score(
        self, model: ModelPort, node: NodeView, candidates: Sequence[Candidate]
    ) -> list[float]:
        """One value in [0, 1] per candidate, in order."""
        ...


@dataclass(frozen=True)
class SelfConsistency:
    name: str = "sc"

    async def score(
        self, model: ModelPort, node: NodeView, candidates: Sequence[Candidate]
    ) -> list[float]:
        total = sum(c.samples for c in candidates) or 1
        return [c.samples / total for c in candidates]


@dataclass(frozen=True)
class LlmValue:
    max_tokens: int = 4
    name: str = "llm"

    async def score(
        self, model: ModelPort, node: NodeView, candidates: Sequence[Candidate]
    ) -> list[float]:
        return list(await asyncio.gather(*(self._one(model, node, c) for c in candidates)))

    async def _one(self, model: ModelPort, node: NodeView, candidate: Candidate) -> float:
        if candidate.kind == StepKind.INVALID:
            return 0.0
        history = transcript_pairs(node.steps)
        prompt = template("value").format(
            transcript=render_transcript(node.observation, history), action=candidate.action
        )
        request = Request(
            config=GenerationConfig(
                temperature=0.0, max_tokens=self.max_tokens, stop=("\n",), seed=node.seed
            ),
            prompt=prompt,
            purpose="value",
            site=replace(node.site, candidate=candidate.action),
        )
        completion = await model.generate(request)
        return parse_rating(completion.text)


def parse_rating(text: str) -> float:
    """A 1-10 rating as a value in [0, 1]; 0.5 when the text holds none."""
    m = _NUMBER.search(text)
    if m is None:
        return 0.5
    number = small_number(m.group())  # None: more digits than any rating has
    rating = 10 if number is None else min(max(number, 1), 10)
    return (rating - 1) / 9


@dataclass(frozen=True)
class Heuristic:
    name: str = "heuristic"

    async def score(
        self, model: ModelPort, node: NodeView, candidates: Sequence[Candidate]
    ) -> list[float]:
        return [self.one(node, c) for c in candidates]

    def one(self, node: NodeView, c: Candidate) -> float:
        if c.kind == StepKind.INVALID:
            return 0.0
        if c.kind == StepKind.THINK:
            return 0.3
        if c.action not in node.state.admissible:
            return 0.05  # the game answers "Nothing happens."
        taken = {s.action for s in node.steps if s.kind == StepKind.ACT}
        if c.action in taken:
            return 0.15
        verb, target = verb_target(c.action)
        seen = node.observation + "".join(s.observation for s in node.steps)
        if verb == "go" and f"arrive at {target}" not in seen:
            return 0.8
        if verb == "open":
            return 0.8
        if verb in STILL_VERBS:
            return 0.3
        return 0.6


def make_value(name: str, ground_truth: GroundTruth = NO_GROUND_TRUTH) -> ValueFunction:
    """A value function by name (``llm``, ``sc``, ``heuristic``, ``oracle``); only ``oracle``
    reads ``ground_truth``."""
    if name == "llm":
        return LlmValue()
    if name == "sc":
        return SelfConsistency()
    if name == "heuristic":
        return Heuristic()
    if name == "oracle":
        return Oracle(ground_truth)
    raise ValueError(f"unknown value function {name!r}: use one of {', '.join(VALUES)}")
