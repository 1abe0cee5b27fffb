"""Scripted policies: no model, the same requests a model gets, deterministic answers.

A policy sees only what a model sees (the prompt or messages, the generation config) plus
``Request.side``, the explicit side channel; each policy lists the keys it reads. Answers are
written the way a model continues an actor prompt that ends with ``>``: a leading space, then
the action (`` go to desk 1``); the actor parses the first line.

- ``scripted:expert`` plays the walkthrough. Reads ``side["walkthrough"]`` (list of commands or
  None) and ``side["history"]`` (the episode's executed actions, thoughts as ``think: ...``):
  the next command is the walkthrough entry after the number of non-thought actions so far.
  At step 0 (``side["step"]``) it first thinks once. Without a walkthrough, or past its end, it
  says ``look``. For ``purpose="reflect"`` it writes a short plan; for ``"judge"`` it answers
  ``SUCCESS`` when the non-thought history equals the walkthrough (``side["walkthrough"]``, or
  the one this backend last saw for ``side["game"]``), else ``FAILURE``.
- ``scripted:random`` picks one of ``side["admissible"]``, seeded by (config.seed,
  ``side["game"]``, ``side["trial"]``, ``side["step"]``): the same request gets the same action.
- ``scripted:learner`` fails a task's first attempt by repeating ``look``, and plays like the
  expert once its prompt holds a memory block: it looks for
  :data:`agents.markers.MEMORY_MARKER` in the prompt text only (no side channel for that).
- ``scripted:replay:<run dir>`` serves the outputs recorded in ``<run dir>/run.sqlite`` for
  (``side["game"]``, ``side["trial"]``, ``side["step"]``); reflections by (game, trial). See
  :func:`recorded_output` for the queries. A request with nothing recorded is a BackendError.

Grounded decoding (``Request.constraint``): a policy picks from ``constraint.actions``.
``random`` draws from them (instead of ``side["admissible"]``, same seeding); ``expert`` and
``learner`` keep their command when it is one of them (or a thought, when ``allow_think``) and
otherwise take :func:`agents.grounding.nearest_action` of it; the answer is ``constraint.lead``
followed by the command. ``replay`` serves what was recorded, constraint or not.

Token counts are words and punctuation marks of the prompt and answer (no tokenizer).
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.grounding import THINK, nearest_action
from agents.llm.base import ActionConstraint, BackendError, Completion, Request, SpecError
from agents.llm.common import rough_token_count, truncate_at_stop
from agents.markers import MEMORY_MARKER

EXPERT_THOUGHT = (
    "think: To solve the task, I need to find the object, act on it as the task says, "
    "and then put it in place."
)
FALLBACK_ACTION = "look"
LEARNER_REPEAT = "look"


def _prompt_text(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    return "\n".join(m.content for m in request.messages or ())


def _acts(history: Sequence[str]) -> list[str]:
    return [h.strip() for h in history if not h.strip().lower().startswith("think:")]


def expert_action(side: dict[str, Any] | Any) -> str:
    """The expert's next action (no leading space) from the side channel."""
    history = list(side.get("history") or [])
    walkthrough = side.get("walkthrough")
    if side.get("step", len(history)) == 0 and not history:
        return EXPERT_THOUGHT
    if not walkthrough:
        return FALLBACK_ACTION
    done = len(_acts(history))
    return str(walkthrough[done]) if done < len(walkthrough) else FALLBACK_ACTION


def random_action(
    side: dict[str, Any] | Any, seed: int | None, admissible: Sequence[str] | None = None
) -> str:
    """A seeded pick from ``admissible`` (default ``side["admissible"]``)."""
    admissible = list(side.get("admissible") or []) if admissible is None else list(admissible)
    if not admissible:
        return FALLBACK_ACTION
    key = f"{seed}|{side.get('game')}|{side.get('trial')}|{side.get('step')}"
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    return str(rng.choice(admissible))


def plan_text(walkthrough: Sequence[str] | None) -> str:
    """A short plausible reflection naming the actions that solve the task."""
    if not walkthrough:
        return (
            "I kept repeating the same action and learned nothing. Next time I will look "
            "around, go to each likely place in turn, and act on the object as soon as I find it."
        )
    steps = ", then ".join(walkthrough[:6])
    more = " and so on" if len(walkthrough) > 6 else ""
    return (
        f"I repeated the same action instead of acting on the task. Next time I will {steps}{more}."
    )


def recorded_output(
    conn: sqlite3.Connection,
    purpose: str,
    game: str,
    trial: int,
    step: int | None,
    arm: str | None = None,
) -> str | None:
    """What the recorded run answered to this request, or None. All the SQL lives here."""
    arm_sql, arm_args = (" AND episodes.arm = ?", [arm]) if arm is not None else ("", [])
    if purpose == "reflect":
        row = conn.execute(
            "SELECT text FROM reflections WHERE task = ? AND trial = ?", (game, trial)
        ).fetchone()
    elif purpose == "judge":
        row = conn.execute(
            "SELECT COALESCE(judge_verdict, '') || COALESCE(' ' || judge_reason, '') "
            "FROM episodes WHERE game = ? AND trial = ? AND judge_verdict IS NOT NULL"
            + arm_sql
            + " LIMIT 1",
            [game, trial, *arm_args],
        ).fetchone()
    else:
        row = conn.execute(
            "SELECT raw_output FROM steps JOIN episodes USING(episode_id) "
            "WHERE episodes.game = ? AND episodes.trial = ? AND steps.idx = ?"
            + arm_sql
            + " LIMIT 1",
            [game, trial, step, *arm_args],
        ).fetchone()
    return None if row is None else str(row[0])


def _pick(answer: str, constraint: ActionConstraint) -> str:
    """The policy's command if the constraint allows it, else the nearest allowed one."""
    answer = answer.strip()
    if answer in constraint.actions:
        return answer
    if not constraint.actions:  # then thoughts are allowed (an ActionConstraint checks it)
        thought = nearest_action(answer, (), allow_think=True)
        return thought if thought.startswith(THINK) else THINK + (thought or "nothing to do")
    return nearest_action(answer, constraint.actions, allow_think=constraint.allow_think)


class ScriptedBackend:
    """A policy behind the Backend interface; see the module docstring."""

    grounding = "scripted policy picks from the constraint's actions"

    def __init__(self, policy: str, *, name: str | None = None, arm: str | None = None) -> None:
        kind, _, arg = policy.partition(":")
        if kind not in ("expert", "random", "learner", "replay"):
            raise SpecError(
                f"unknown scripted policy {kind!r}; choose expert, random, learner, replay:<dir>"
            )
        self.policy = kind
        self.name = name or f"scripted:{policy}"
        self.arm = arm
        self._walkthroughs: dict[str, list[str]] = {}
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.run_dir: Path | None = None
        if kind == "replay":
            self.run_dir = Path(arg)
            db = self.run_dir / "run.sqlite"
            if not db.is_file():
                raise SpecError(f"scripted:replay: no run store at {db}; pass a run directory")
            self._db = sqlite3.connect(f"file:{db}?mode=ro", uri=True, check_same_thread=False)
        elif arm is not None:
            raise SpecError("option arm= is only for scripted:replay")

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"spec": self.name, "backend": "scripted", "policy": self.policy}
        if self.run_dir is not None:
            info["run_dir"] = str(self.run_dir)
            info["arm"] = self.arm
        return info

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return [self._one(r) for r in requests]

    def _one(self, request: Request) -> Completion:
        side = request.side
        game = side.get("game")
        if game is not None and side.get("walkthrough"):
            self._walkthroughs[str(game)] = list(side["walkthrough"])
        text = self._answer(request)
        grounded = request.purpose == "act" and self.policy != "replay"
        if grounded and request.constraint is not None:
            text = request.constraint.lead + _pick(text, request.constraint)
        elif grounded and not text.startswith(" "):
            text = " " + text  # what a model writes after the prompt's final ">"
        text, _ = truncate_at_stop(text, request.config.stop)
        prompt = _prompt_text(request)
        return Completion(
            text=text,
            finish_reason="stop",
            prompt_tokens=rough_token_count(prompt),
            completion_tokens=rough_token_count(text),
            sent={"policy": self.name},
        )

    def _walkthrough(self, side: Any) -> list[str] | None:
        wt = side.get("walkthrough")
        if wt:
            return list(wt)
        return self._walkthroughs.get(str(side.get("game")))

    def _answer(self, request: Request) -> str:
        side = request.side
        if self.policy == "replay":
            return self._replay(request)
        if request.purpose == "reflect":
            if self.policy == "random":
                return "I acted at random. Next time I will plan before acting."
            return plan_text(self._walkthrough(side))
        if request.purpose == "judge":
            wt = self._walkthrough(side)
            acts = _acts(side.get("history") or [])
            if wt and acts == [w.strip() for w in wt]:
                return "SUCCESS: the actions match the walkthrough."
            return "FAILURE: the actions do not match the walkthrough."
        if self.policy == "random":
            actions = request.constraint.actions if request.constraint is not None else None
            return random_action(side, request.config.seed, actions or None)
        if self.policy == "learner" and MEMORY_MARKER not in _prompt_text(request):
            return LEARNER_REPEAT
        return expert_action(side)

    def _replay(self, request: Request) -> str:
        side = request.side
        game, trial, step = side.get("game"), side.get("trial"), side.get("step")
        if game is None or trial is None or (request.purpose == "act" and step is None):
            raise BackendError(
                "scripted:replay needs side['game'], side['trial'] and, to act, side['step']"
            )
        assert self._db is not None
        with self._lock:
            text = recorded_output(self._db, request.purpose, str(game), int(trial), step, self.arm)
        if text is None:
            raise BackendError(
                f"scripted:replay: nothing recorded for {request.purpose} of game {game!r} "
                f"trial {trial} step {step} in {self.run_dir}"
            )
        return text

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
