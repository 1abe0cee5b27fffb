"""Scripted policies: no model, the same requests a model gets, deterministic answers.

A policy sees only what a model sees (the prompt or messages, the generation config) plus
``Request.site`` (the typed :class:`~agents.llm.base.CallSite`; each policy lists the fields it
reads) and, for policies that play from the game's walkthrough, the backend's
:class:`~agents.llm.ground_truth.GroundTruth` (``ground_truth=``; the run hands it the game
files' walkthroughs), looked up by ``site.game``. Answers are
written the way a model continues an actor prompt that ends with ``>``: a leading space, then
the action (`` go to desk 1``); the actor parses the first line.

- ``scripted:expert`` plays the walkthrough. Reads the game's walkthrough (ground truth) and
  ``site.history`` (the episode's executed actions, thoughts as ``think: ...``):
  the next command is the walkthrough entry after the number of non-thought actions so far.
  At step 0 (``site.step``) it first thinks once. Without a walkthrough, or past its end, it
  says ``look``. For ``purpose="reflect"`` it writes a short plan; for ``"judge"`` it answers
  ``SUCCESS`` when the non-thought history equals the walkthrough, else ``FAILURE``.
- ``scripted:random`` picks one of ``site.admissible``, seeded by (config.seed,
  ``site.game``, ``site.trial``, ``site.step``): the same request gets the same action.
- ``scripted:learner`` fails a task's first attempt by repeating ``look``, and plays like the
  expert once its prompt holds a memory block: it looks for
  :data:`agents.llm.markers.MEMORY_MARKER` in the prompt text only (no side channel for that).
- ``scripted:ruled`` plays like the expert only when its prompt holds a learned rule naming its
  own task type (a line ``For <type> tasks`` in the block under
  :data:`agents.llm.markers.RULES_MARKER`; the type is read from the task's description in the
  prompt), and repeats ``look`` otherwise.
- ``scripted:replay:<run dir>`` serves the outputs recorded in ``<run dir>/run.sqlite`` for
  (``site.game``, ``site.trial``, ``site.step``); reflections by (game, trial). See
  :func:`recorded_output` for the queries. A request with nothing recorded is a BackendError.
- ``scripted:replanner`` executes the latest plan in its transcript (the last ``think: Plan:``
  or ``think: Revised plan ...`` entry of ``site.history``: the plan's next action after the
  actions taken since it; ``look`` past its end). Its first plan fails: the walkthrough's first
  action, then an action the game refuses, three times, and nothing more; a replan
  (``site.replan``) is the rest of the walkthrough.
- ``scripted:deadend`` proposes, at the first step, a dead end first (a ``go to`` elsewhere than
  the walkthrough's first action; the majority of ``n`` samples), and the walkthrough action in
  the other samples; inside the dead end it repeats ``look``; elsewhere it plays the expert.

Rule extraction (``purpose="insights"``): every policy but replay agrees with the first rule
shown (``AGREE 1``) when the prompt numbers one, else adds ``ADD: For <type> tasks, ...`` for
the type on its :data:`agents.llm.markers.TASK_TYPE_LINE` line.

Plans (``purpose="plan"``): the expert's, the learner's and the random policy's plan is the
walkthrough, numbered; a replan is the part of it not yet done (walkthrough actions matched in
order by the history). Values (``purpose="value"``): the expert rates ``site.candidate`` 10
when it is the walkthrough's next action, else 2; other policies say 5. Reflections in the
``critique`` format (``site.reflection_format``): the expert writes the JSON; the others write
free text.
``config.n`` samples: the first is the answer, the others ``alternatives``; the random policy
draws each from the admissible commands, seeded also by the history and the sample's number.

Grounded decoding (``Request.constraint``): a policy picks from ``constraint.actions``.
``random`` draws from them (instead of ``site.admissible``, same seeding); ``expert`` and
``learner`` keep their command when it is one of them (or a thought, when ``allow_think``) and
otherwise take :func:`agents.llm.grounding.nearest_action` of it; the answer is ``constraint.lead``
followed by the command. ``replay`` serves what was recorded, constraint or not.

Token counts are words and punctuation marks of the prompt and answer (no tokenizer).
``Completion.sent`` holds what a model would get: the prompt, or with ``chat_format`` ``user`` or
``prefill`` the chat messages a chat backend wraps it in (:func:`agents.llm.common.prompt_as_messages`),
and the sampling settings.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.llm.base import (
    ActionConstraint,
    BackendError,
    CallSite,
    Completion,
    Request,
    SpecError,
)
from agents.llm.common import (
    CHAT_FORMATS,
    CONTINUE_INSTRUCTION,
    PrefixTokenCount,
    request_messages,
    rough_token_count,
    sampling_dict,
    truncate_at_stop,
)
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.llm.grounding import THINK, nearest_action
from agents.llm.markers import (
    MEMORY_MARKER,
    RULES_MARKER,
    TASK_LINE,
    TASK_TYPE_LINE,
    plan_items,
)

REFUSED_ACTION = "examine the ceiling"  # not a command of any game: "Nothing happens."
EXPERT_THOUGHT = (
    "think: To solve the task, I need to find the object, act on it as the task says, "
    "and then put it in place."
)
FALLBACK_ACTION = "look"
POLICIES = ("expert", "random", "learner", "replanner", "deadend", "ruled", "replay")
LEARNER_REPEAT = "look"


def _prompt_text(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    return "\n".join(m.content for m in request.messages or ())


def _acts(history: Sequence[str]) -> list[str]:
    return [h.strip() for h in history if not h.strip().lower().startswith("think:")]


def expert_action(site: CallSite, walkthrough: Sequence[str] | None) -> str:
    """The expert's next action (no leading space) at this call site."""
    history = site.history
    step = len(history) if site.step is None else site.step
    if step == 0 and not history:
        return EXPERT_THOUGHT
    if not walkthrough:
        return FALLBACK_ACTION
    done = len(_acts(history))
    return str(walkthrough[done]) if done < len(walkthrough) else FALLBACK_ACTION


def random_action(
    site: CallSite,
    seed: int | None,
    sample: int | None = None,
    admissible: Sequence[str] | None = None,
) -> str:
    """A seeded uniform choice among ``admissible`` (default ``site.admissible``); the
    ``sample``-th of ``n`` is also keyed by the history, so two states at one depth draw
    differently."""
    admissible = list(site.admissible) if admissible is None else list(admissible)
    if not admissible:
        return FALLBACK_ACTION
    key = f"{seed}|{site.game}|{site.trial}|{site.step}"
    if sample is not None:
        key += f"|{'|'.join(site.history)}|{sample}"
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    return str(rng.choice(admissible))


def walkthrough_progress(walkthrough: Sequence[str], history: Sequence[str]) -> int:
    """How many walkthrough actions the history took, in order."""
    done = 0
    for action in _acts(history):
        if done < len(walkthrough) and action == walkthrough[done].strip():
            done += 1
    return done


def numbered(actions: Sequence[str]) -> str:
    return "\n".join(f"{i}. {a}" for i, a in enumerate(actions, 1)) or "1. look"


def plan_answer(policy: str, site: CallSite, walkthrough: list[str] | None) -> str:
    """The plan a scripted policy writes (module docstring)."""
    wt = list(walkthrough or [])
    if site.replan:
        return numbered(wt[walkthrough_progress(wt, site.history) :])
    if policy == "replanner":
        return numbered([*wt[:1], REFUSED_ACTION, REFUSED_ACTION, REFUSED_ACTION])
    return numbered(wt)


def follow_plan(history: Sequence[str]) -> str:
    """The next action of the latest plan in the history (``look`` past its end)."""
    for i in range(len(history) - 1, -1, -1):
        items = plan_items(history[i].strip())
        if items or history[i].strip().lower().startswith("think: plan"):
            done = len(_acts(history[i + 1 :]))
            return items[done] if done < len(items) else FALLBACK_ACTION
    return FALLBACK_ACTION


def deadend_action(site: CallSite, walkthrough: list[str] | None, sample: int, n: int) -> str:
    """The dead-end proposer's ``sample``-th of ``n`` samples (module docstring)."""
    wt = list(walkthrough or [])
    acts = _acts(site.history)
    trap = next(
        (a for a in site.admissible if a.startswith("go to ") and wt and a != wt[0]),
        FALLBACK_ACTION,
    )
    if not acts:
        return trap if sample < n // 2 + 1 else (wt[0] if wt else FALLBACK_ACTION)
    if not wt or acts[0] != wt[0].strip():
        return LEARNER_REPEAT  # in the dead end
    done = len(acts)
    return wt[done] if done < len(wt) else FALLBACK_ACTION


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


def critique_json(walkthrough: Sequence[str] | None, history: Sequence[str]) -> str:
    """The expert's critique: the walkthrough actions not taken, the actions taken that are
    not in it, and the plan."""
    wt = [w.strip() for w in walkthrough or []]
    acts = _acts(history)
    return json.dumps(
        {
            "missing": [w for w in wt if w not in acts],
            "superfluous": sorted({a for a in acts if a not in wt}),
            "plan": plan_text(wt),
        }
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


def rule_for(task_type: str) -> str:
    """The rule the scripted policies write for a task type (the one ``ruled`` looks for)."""
    return f"For {task_type} tasks, find the object first, act on it, then put it in place."


def insights_answer(prompt: str) -> str:
    """The scripted answer to a rule-extraction prompt (module docstring)."""
    if "\n1. " in prompt:
        return "AGREE 1"
    _, found, rest = prompt.partition(TASK_TYPE_LINE)
    task_type = rest.split("\n", 1)[0].strip() if found else "these"
    return f"ADD: {rule_for(task_type)}"


# ALFWorld's task descriptions by type ("put a hot apple in fridge", "heat some apple and put
# it in fridge"): a word that names the type, checked in this order; otherwise ``put``
_TYPE_WORDS = (
    ("puttwo", ("two",)), ("examine", ("desklamp", "examine", "look")), ("heat", ("hot", "heat")),
    ("cool", ("cool", "cold")), ("clean", ("clean",)),
)  # fmt: skip


def task_type_of(prompt: str) -> str:
    """The task type of the prompt's task (its last ``Your task is to:`` line), as a reader of
    the text would tell it."""
    _, _, rest = prompt.rpartition(TASK_LINE)
    words = set(rest.split("\n", 1)[0].lower().replace(".", " ").split())
    return next((t for t, names in _TYPE_WORDS if words & set(names)), "put")


def has_rule_for(prompt: str) -> bool:
    """Whether the rules block of ``prompt`` names the task type of its task."""
    if RULES_MARKER not in prompt:
        return False
    block = prompt.split(RULES_MARKER, 1)[1].split("\n\n", 1)[0]
    return f"For {task_type_of(prompt)} tasks" in block


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
    scheduling = "inline"  # answers at once: the engine calls it on its loop

    def __init__(
        self,
        policy: str,
        *,
        name: str | None = None,
        arm: str | None = None,
        ground_truth: GroundTruth = NO_GROUND_TRUTH,
        chat_format: str = "raw",
        chat_instruction: str = CONTINUE_INSTRUCTION,
    ) -> None:
        kind, _, arg = policy.partition(":")
        if chat_format not in CHAT_FORMATS:
            raise SpecError(f"chat_format={chat_format!r}: use one of {', '.join(CHAT_FORMATS)}")
        self.chat_format = chat_format
        self.chat_instruction = chat_instruction
        if kind not in POLICIES:
            raise SpecError(
                f"unknown scripted policy {kind!r}; choose one of {', '.join(POLICIES[:-1])},"
                " replay:<dir>"
            )
        self.policy = kind
        self.name = name or f"scripted:{policy}"
        self.arm = arm
        self.ground_truth = ground_truth
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._prompt_tokens = PrefixTokenCount()  # an episode's prompts extend each other
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
        if self.chat_format != "raw":
            info["chat_format"] = self.chat_format
        if self.run_dir is not None:
            info["run_dir"] = str(self.run_dir)
            info["arm"] = self.arm
        return info

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return [self._one(r) for r in requests]

    def _one(self, request: Request) -> Completion:
        n = request.config.n if request.purpose == "act" else 1
        texts = [self._answer(request, k, n) for k in range(n)]
        grounded = request.purpose == "act" and self.policy != "replay"
        for i, text in enumerate(texts):
            if grounded and request.constraint is not None:
                text = request.constraint.lead + _pick(text, request.constraint)
            elif grounded and not text.startswith(" "):
                text = " " + text  # what a model writes after the prompt's final ">"
            texts[i], _ = truncate_at_stop(text, request.config.stop)
        prompt = _prompt_text(request)
        return Completion(
            text=texts[0],
            finish_reason="stop",
            prompt_tokens=self._prompt_tokens((request.site.episode, request.purpose), prompt),
            completion_tokens=sum(rough_token_count(t) for t in texts),
            sent=self._sent(request),
            alternatives=tuple(texts[1:]),
        )

    def _sent(self, request: Request) -> dict[str, Any]:
        """What a model would get: the prompt as text, or as the chat messages ``chat_format``
        wraps it in (as a chat backend sends it), with the sampling settings."""
        sent: dict[str, Any] = {"policy": self.name, "sampling": sampling_dict(request)}
        if request.prompt is not None and self.chat_format == "raw":
            sent["prompt"] = request.prompt
        else:
            sent["messages"] = request_messages(request, self.chat_format, self.chat_instruction)
        return sent

    def _walkthrough(self, site: CallSite) -> list[str] | None:
        """The call site's game's walkthrough: answers depend on the request and the game files
        alone, never on the requests this backend saw before (a resumed run's fresh backend
        answers the same)."""
        return None if site.game is None else self.ground_truth.walkthrough(site.game)

    def _answer(self, request: Request, sample: int = 0, n: int = 1) -> str:
        site = request.site
        if self.policy == "replay":
            return self._replay(request)
        if request.purpose == "plan":
            return plan_answer(self.policy, site, self._walkthrough(site))
        if request.purpose == "value":
            if self.policy != "expert":
                return "5"
            path = self._walkthrough(site) or []
            done = len(_acts(site.history))
            best = path[done].strip() if done < len(path) else None
            return "10" if site.candidate == best else "2"
        if request.purpose == "reflect":
            if self.policy == "random":
                return "I acted at random. Next time I will plan before acting."
            if site.reflection_format == "critique" and self.policy == "expert":
                return critique_json(self._walkthrough(site), site.history)
            return plan_text(self._walkthrough(site))
        if request.purpose == "insights":
            return insights_answer(_prompt_text(request))
        if request.purpose == "judge":
            wt = self._walkthrough(site)
            acts = _acts(site.history)
            if wt and acts == [w.strip() for w in wt]:
                return "SUCCESS: the actions match the walkthrough."
            return "FAILURE: the actions do not match the walkthrough."
        if self.policy == "random":
            actions = request.constraint.actions if request.constraint is not None else None
            return random_action(
                site, request.config.seed, sample if n > 1 else None, actions or None
            )
        if self.policy == "learner" and MEMORY_MARKER not in _prompt_text(request):
            return LEARNER_REPEAT
        if self.policy == "ruled" and not has_rule_for(_prompt_text(request)):
            return LEARNER_REPEAT
        if self.policy == "replanner":
            return follow_plan(site.history)
        if self.policy == "deadend":
            return deadend_action(site, self._walkthrough(site), sample, n)
        return expert_action(site, self._walkthrough(site))

    def _replay(self, request: Request) -> str:
        site = request.site
        game, trial, step = site.game, site.trial, site.step
        if game is None or trial is None or (request.purpose == "act" and step is None):
            raise BackendError(
                "scripted:replay needs the call site's game, trial and, to act, step"
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
