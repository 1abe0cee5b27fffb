"""Records of what happened: steps, episodes, reflections, exploration facts.

Records are frozen dataclasses; ``to_dict``/``from_dict`` give a JSON-safe form, so memory is
always typed data and never text parsed back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self


class StepKind(StrEnum):
    ACT = "act"  # an action sent to the env
    THINK = "think"  # a thought; the env is not consulted, the observation is "OK."
    INVALID = "invalid"  # empty/unparseable output; not sent to the env ("Nothing happens.")


class EpisodeStatus(StrEnum):
    RUNNING = "running"
    DONE = "done"  # finished normally (won or failed)
    ERROR = "error"  # the harness failed (backend/network/worker): not the agent's failure
    INTERRUPTED = "interrupted"  # left in play when its run stopped (signal, budget); resumed


class FailureClass(StrEnum):
    REPEATED_ACTION = "repeated_action"  # hallucination loop
    TOO_LONG = "too_long"  # inefficient planning
    STEP_CAP = "step_cap"  # hit the env's step limit
    INVALID_ACTIONS = "invalid_actions"  # mostly inadmissible or unparseable actions
    INFRA_ERROR = "infra_error"  # the harness, not the agent
    OTHER = "other"
    OSCILLATING = "oscillating"  # repeated an earlier trial's actions exactly: not retried
    CONTEXT_LIMIT = "context_limit"  # its prompt outgrew the model's context: not retried
    # how a tree search (agents.lats) ended without a win
    SEARCH_ITERATIONS = "search_iterations"  # its iteration budget was spent
    SEARCH_NODES = "search_nodes"  # its node cap was reached
    SEARCH_ENV_STEPS = "search_env_steps"  # its env step budget (replays included) was spent
    SEARCH_TOKENS = "search_tokens"  # its token budget was spent
    SEARCH_TIME = "search_time"  # its wall-time budget was spent
    SEARCH_EXHAUSTED = "search_exhausted"  # every branch failed


@dataclass(frozen=True)
class EndClass:
    """One way an arm's episodes can end unwon: its failure class and, for an end the agent
    tells apart by its verdict, the words that verdict carries (``marker``)."""

    failure_class: FailureClass
    marker: str = ""


def classify_end(
    failure_class: str | None, verdict: str | None, ends: tuple[EndClass, ...]
) -> FailureClass:
    """The class of an unwon episode's end: the recorded one, unless that is ``other`` (or none)
    and the verdict carries one of ``ends``' markers: then that end's class. Applied when the
    agent ends an episode and again on read, so ends recorded as ``other`` before their arm
    declared a class for them are classed too."""
    recorded = FailureClass(failure_class) if failure_class else FailureClass.OTHER
    if recorded is not FailureClass.OTHER or not verdict:
        return recorded
    for end in ends:
        if end.marker and end.marker in verdict:
            return end.failure_class
    return recorded


class _Record:
    def to_dict(self) -> dict[str, Any]:
        """``dataclasses.asdict``'s answer, without its deep copy of each value (records are
        frozen and their values immutable): a report's page converts every step and call."""
        return {name: _plain(getattr(self, name)) for name in _field_names(type(self))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return cls(**data)


_NAMES: dict[type, tuple[str, ...]] = {}  # each record class's field names


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_AS_IS = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    """A record's value as ``asdict`` gives it: a nested record as its dict, a list, tuple or
    dict with each item so, anything else as it is."""
    if type(value) in _AS_IS:
        return value
    if isinstance(value, _Record):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Step(_Record):
    """One actor step: what the model said, what was executed, what the game answered."""

    index: int
    kind: str  # a StepKind value
    raw_output: str  # the model's text, untrusted
    action: str  # what was executed (after parsing and grounding); "" for invalid
    observation: str
    admissible: bool = True  # the executed action was in the admissible commands
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    reward: float = 0.0
    won: bool = False


@dataclass(frozen=True)
class EnvReply:
    """What the game answered to a reset or a step. After a reset, reward is 0.0 and both flags
    are False (unless replayed actions ended the episode: then they are the last replayed step's)."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def won(self) -> bool:
        return bool(self.terminated and self.info.get("won"))

    @property
    def admissible(self) -> tuple[str, ...]:
        return tuple(self.info.get("admissible_commands") or ())


def env_actions(steps: Iterable[Step]) -> tuple[str, ...]:
    """The actions of ``steps`` that reached the env (thoughts and invalid outputs never do):
    what re-simulates an episode, and what two trials compare."""
    return tuple(s.action for s in steps if s.kind == StepKind.ACT)


@dataclass(frozen=True)
class SentRequest(_Record):
    """A model request exactly as its backend sent it: the completion-style ``prompt`` or the
    chat ``messages`` (``(role, content)`` pairs), one of the two, and every other field it
    sent (``params``: endpoint, model, sampling, seed, stop strings, a grammar or
    structured-output spec, ...). It never holds a key: it is made through the one redaction
    pass (:mod:`agents.llm.redaction`)."""

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a SentRequest holds exactly one of prompt or messages")
        if self.messages is not None:
            pairs = tuple((str(r), str(c)) for r, c in self.messages)
            object.__setattr__(self, "messages", pairs)

    @property
    def text(self) -> str:
        """The prompt, or the messages as one text (JSON ``[[role, content], ...]``): what the
        store keeps, as what it adds to an earlier request's text."""
        if self.prompt is not None:
            return self.prompt
        return json.dumps([list(m) for m in self.messages or ()], ensure_ascii=False)

    @classmethod
    def of_text(cls, form: str, text: str, params: Mapping[str, Any]) -> SentRequest:
        """The inverse of :attr:`text` (``form``: :attr:`form`)."""
        if form == "messages":
            return cls(messages=tuple((r, c) for r, c in json.loads(text)), params=params)
        return cls(prompt=text, params=params)

    @property
    def form(self) -> str:
        return "text" if self.prompt is not None else "messages"

    @property
    def chat(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts (empty for a text prompt)."""
        return [{"role": r, "content": c} for r, c in self.messages or ()]


@dataclass(frozen=True)
class ModelCall(_Record):
    """One model call of any purpose (act, reflect, judge, plan, value, ...): where it was made,
    the request as its backend sent it, the answer, and what it cost.

    Every call is recorded, so budgets, cost and reports count everything; readers show its
    request as recorded. ``rebuilt`` is a reader's mark: the request was not recorded (a store
    written before requests were) and ``sent`` holds a prompt rebuilt from the steps.
    """

    purpose: str
    game: str
    trial: int
    episode_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    retries: int = 0
    error: str | None = None  # the call failed (after its retries): why
    step: int | None = None  # the call site's step: the steps its episode had taken
    sent: SentRequest | None = None  # None: not recorded (a store older than the record)
    answer: str | None = None  # the model's text, untrusted
    alternatives: tuple[str, ...] = ()  # the other samples when n > 1
    finish_reason: str | None = None
    attempt_errors: tuple[str, ...] = ()  # why each failed attempt failed, in order
    rebuilt: bool = False
    id: int | None = field(default=None, compare=False)  # its row in the store (readers set it)


@dataclass(frozen=True)
class Reflection(_Record):
    """A self-reflection written after a failed trial, with its provenance."""

    task: str  # game id
    trial: int
    episode_id: str
    model: str
    prompt_hash: str
    text: str  # the model's text, untrusted


@dataclass(frozen=True)
class ExplorationFact(_Record):
    """Something the agent established about a place in an earlier trial of the same task."""

    place: str  # e.g. "drawer 3"
    contents: tuple[str, ...]  # what was seen there; empty means "nothing"
    trial: int
    opened: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        data = dict(data)
        data["contents"] = tuple(data.get("contents", ()))
        return super().from_dict(data)


@dataclass(frozen=True)
class SearchNode(_Record):
    """One node of a search tree: the state after ``action`` (the root: the first observation).

    ``observation`` is None until the node is executed (search agents execute lazily). ``value``
    is the value function's estimate; ``visits`` and ``total`` are the back-propagated rewards.
    """

    node_id: int
    parent_id: int | None
    depth: int
    kind: str  # a StepKind value ("" for the root)
    raw_output: str
    action: str
    observation: str | None = None
    admissible: bool = True
    value: float = 0.0
    visits: int = 0
    total: float = 0.0
    samples: int = 1  # how many of the expansion's samples proposed this action
    terminal: bool = False
    won: bool = False
    chosen: bool = False  # on the path written as the episode's steps
    reflection: str | None = None  # written after a failed rollout that ended here
    iteration: int = 0  # the iteration that created it
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class SearchIteration(_Record):
    """One iteration of a tree search and what it cost (replays are the restores' env steps)."""

    iteration: int
    selected: int  # the node the selection reached
    leaf: int  # the last node of the rollout
    reward: float
    env_steps: int = 0  # actions stepped for the first time
    replay_steps: int = 0  # actions re-simulated to restore a node
    resets: int = 0
    nodes_added: int = 0
    tokens: int = 0
    backtrack: bool = False  # the selection left the previous iteration's path
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class SearchEnd(_Record):
    """How a search ended: the node whose path became the episode's steps, and why."""

    best_node: int
    won: bool
    reason: str


@dataclass(frozen=True)
class SearchTree:
    """A stored search: its nodes (by id order), iterations, and its end once it ended."""

    nodes: tuple[SearchNode, ...]
    iterations: tuple[SearchIteration, ...]
    end: SearchEnd | None = None


@dataclass(frozen=True)
class ReflectionNote(_Record):
    """How a memory item was made: its format, whether the length cap cut it, and (critique)
    why its JSON was refused when the free text was kept instead."""

    task: str
    trial: int
    format: str  # free | critique | epm
    chars: int  # of the text kept
    truncated_from: int | None = None  # the length before the cap, when it cut the text
    parse_error: str | None = None
    raw: str = ""  # the model's text, untrusted
