"""Experience across tasks: what a gathering run played on other games, where it came from, and
which of it a new task may see.

An :class:`Experience` is read from a finished run (``experiments.experience`` reads the store):
every finished attempt with its outcome, the rules extracted from them (:mod:`agents.insights`),
and its :class:`Provenance` (run, split, game file hashes, digest), which the runner checks
against the games a run plays before the run starts and records in its manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agents.llm.markers import TASK_LINE
from agents.options import option
from agents.prompting import render_transcript, template

SCOPES = ("type", "similar", "all")
SIMILARITIES = ("lexical", "embedding")  # how trajectories are ranked
RETRIEVE_MODES = ("replace", "join")  # retrieved trajectories instead of, or before, the examples
# task-type families for the ``similar`` scope: placing, changing the object's state, looking
FAMILIES = (
    frozenset({"put", "puttwo"}),
    frozenset({"clean", "heat", "cool"}),
    frozenset({"examine"}),
)


def in_scope(scope: str, own: str, other: str) -> bool:
    """Whether a task of type ``own`` may see experience of type ``other``."""
    if scope == "all":
        return True
    if scope == "similar":
        return any(own in f and other in f for f in FAMILIES) or own == other
    return own == other


@dataclass(frozen=True)
class Attempt:
    """One finished episode of the gathering run."""

    game: str
    task_type: str
    trial: int
    won: bool
    observation: str
    steps: tuple[tuple[str, str], ...]  # (action text, observation), as transcripts show them

    def text(self) -> str:
        return render_transcript(self.observation, self.steps)

    @property
    def task(self) -> str:
        """The task description (the observation's ``Your task is to:`` line, else all of it)."""
        return task_description(self.observation)


def task_description(observation: str) -> str:
    _, found, rest = observation.rpartition(TASK_LINE)
    return rest.strip() if found else observation.strip()


@dataclass(frozen=True)
class Rule:
    """One rule of the extracted list: the task type whose attempts made it, and its votes."""

    task_type: str
    text: str
    votes: int

    def to_json(self) -> dict[str, object]:
        return {"task_type": self.task_type, "text": self.text, "votes": self.votes}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Rule:
        """The rule :meth:`to_json` wrote; a KeyError, TypeError or ValueError for anything
        else (a stored list is another run's data: it may have been edited)."""
        task_type, text, votes = data["task_type"], data["text"], data["votes"]
        if not isinstance(task_type, str) or not isinstance(text, str):
            raise TypeError("its task_type and text are not both strings")
        if isinstance(votes, bool) or not isinstance(votes, int) or votes < 1:
            raise ValueError(f"its votes ({votes!r}) are not a whole number >= 1")
        return cls(task_type, text, votes)


def rules_block(rules: Sequence[Rule]) -> str:
    """The rules at the top of an actor prompt ('' when none)."""
    if not rules:
        return ""
    return template("rules_block").format(rules="\n".join(f"- {r.text}" for r in rules))


@dataclass(frozen=True)
class Retrieved:
    """A won attempt shown in place of the few-shot examples, and how like the new task's its
    task description scored (the similarity's own scale)."""

    attempt: Attempt
    score: float

    def to_json(self) -> dict[str, object]:
        a = self.attempt
        score = self.score if math.isfinite(self.score) else None  # JSON has no NaN
        return {"game": a.game, "trial": a.trial, "task_type": a.task_type, "score": score}


@dataclass(frozen=True)
class Shown:
    """The experience of other games one episode's prompt shows: the rules above it and the
    retrieved attempts in place of its few-shot examples (the prompt is made from this record,
    and the run store keeps it with the episode)."""

    rules: tuple[Rule, ...] = ()
    retrieved: tuple[Retrieved, ...] = ()
    join: bool = False  # the packaged examples follow the retrieved attempts (retrieve_mode join)

    def to_json(self) -> dict[str, object]:
        return {
            "rules": [r.to_json() for r in self.rules],
            "retrieved": [r.to_json() for r in self.retrieved],
            "examples": "join" if self.join else "replace",
        }


@dataclass(frozen=True)
class Provenance:
    """Where experience comes from: the run, its split, its games (id -> file hash), and the
    digest of everything it holds (attempts and rules)."""

    run: str
    split: str
    games: Mapping[str, str]
    digest: str

    def to_json(self) -> dict[str, object]:
        return {"run": self.run, "split": self.split, "digest": self.digest}


@dataclass(frozen=True)
class ExperienceConfig:
    """Experience of other games (agents insights, retrieve): a gathering run's rules, trajectories."""

    experience_from: str | None = option(
        None, "run directory of the gathering run whose experience is shown (rules, trajectories)"
    )
    experience_scope: str = option(
        "type",
        "which tasks' experience a task sees: type (its own task type), similar (its family: "
        "put/puttwo, clean/heat/cool, examine), all",
        choices=SCOPES,
    )
    retrieve_k: int = option(
        2, "successful trajectories shown in place of the few-shot examples (retrieve)", minimum=1
    )
    retrieve_mode: str = option(
        "replace",
        "the retrieved trajectories replace the packaged few-shot examples (replace) or come "
        "before them (join)",
        choices=RETRIEVE_MODES,
    )
    similarity: str = option(
        "lexical",
        "how trajectories are ranked by task description: lexical (BM25) or embedding "
        "(the embedding extra)",
        choices=SIMILARITIES,
    )
    vote_floor: int = option(1, "rules with fewer votes than this are not shown", minimum=1)


@dataclass(frozen=True)
class Experience:
    provenance: Provenance
    attempts: tuple[Attempt, ...]
    rules: tuple[Rule, ...] = ()
    settings: ExperienceConfig = field(default_factory=ExperienceConfig)

    def rules_for(self, task_type: str) -> tuple[Rule, ...]:
        """The rules a task of ``task_type`` is shown: in scope, with enough votes."""
        s = self.settings
        return tuple(
            r
            for r in self.rules
            if r.votes >= s.vote_floor and in_scope(s.experience_scope, task_type, r.task_type)
        )

    def successes_for(self, task_type: str) -> tuple[Attempt, ...]:
        """The won attempts in scope for a task of ``task_type``."""
        return tuple(
            a
            for a in self.attempts
            if a.won and in_scope(self.settings.experience_scope, task_type, a.task_type)
        )


def digest(attempts: tuple[Attempt, ...], rules: tuple[Rule, ...]) -> str:
    """sha256 of the attempts and rules (what a run that uses them records)."""
    body = json.dumps(
        [
            [[a.game, a.task_type, a.trial, a.won, a.observation, a.steps] for a in attempts],
            [r.to_json() for r in rules],
        ],
        sort_keys=True,
    )
    return hashlib.sha256(body.encode("utf-8")).hexdigest()
