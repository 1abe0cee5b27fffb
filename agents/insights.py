"""Rules learned across tasks: extracted from a gathering run, shown at the top of new prompts.

Extraction (:func:`extract`): the gathering run's tasks that have both a failed and a won
attempt are taken in batches of one task type; for each batch the model is shown the pairs and
the rules of that type so far (numbered), and answers with operations, one a line:
``ADD: text`` (a new rule, one vote), ``EDIT n: text`` (rule n rewritten, one more vote),
``AGREE n`` (one more vote), ``REMOVE n`` (one vote less; a rule at no votes is gone). Anything
else on a line is ignored and recorded as such: model output never stops an extraction. Every
call (prompt, answer, operations applied, the list after it) is kept with the rules.

The ``insights`` arm is Reflexion with the rules in scope (:func:`agents.experience.in_scope`)
and with at least the vote floor shown above the prompt (:data:`INSIGHTS`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agents.arm import Arm
from agents.episode import ModelPort
from agents.experience import Attempt, ExperienceConfig, Rule
from agents.llm.answers import small_number
from agents.llm.base import CallSite, GenerationConfig, Request
from agents.memory_policy import PastTrials, Recall, ReflexionWindow
from agents.prompting import template
from agents.react import build_react
from agents.reflexion import ReflexionSettings

BATCH_TASKS = 4  # tasks compared per extraction call
_OP = re.compile(r"^\s*(ADD|EDIT|AGREE|REMOVE)\b\s*(\d+)?\s*:?\s*(.*)$", re.IGNORECASE)


@dataclass(frozen=True)
class Op:
    kind: str  # ADD | EDIT | AGREE | REMOVE
    number: int | None  # the rule's number in the list shown (1-based); None for ADD
    text: str


def parse_ops(text: str) -> tuple[list[Op], list[str]]:
    """The operations in a model's answer, and the lines that are none (ignored)."""
    ops: list[Op] = []
    ignored: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _OP.match(line.strip().lstrip("-* "))
        kind = m.group(1).upper() if m else ""
        digits = m.group(2) if m else None
        number = small_number(digits) if digits else None
        body = m.group(3).strip() if m else ""
        if digits and number is None:  # a number no rule list has
            ignored.append(line.strip())
        elif kind == "ADD" and body and number is None:
            ops.append(Op(kind, None, body))
        elif kind == "EDIT" and number is not None and body:
            ops.append(Op(kind, number, body))
        elif kind in ("AGREE", "REMOVE") and number is not None:
            ops.append(Op(kind, number, ""))
        else:
            ignored.append(line.strip())
    return ops, ignored


def apply_ops(
    rules: Sequence[Rule], task_type: str, ops: Sequence[Op]
) -> tuple[tuple[Rule, ...], list[str]]:
    """The rule list after ``ops`` (numbers refer to the ``task_type`` rules as shown), and the
    operations that named no rule (ignored)."""
    shown = [i for i, r in enumerate(rules) if r.task_type == task_type]
    out: list[Rule | None] = list(rules)
    ignored: list[str] = []
    for op in ops:
        if op.kind == "ADD":
            out.append(Rule(task_type, op.text, 1))
            continue
        assert op.number is not None
        index = shown[op.number - 1] if 1 <= op.number <= len(shown) else None
        rule = out[index] if index is not None else None
        if index is None or rule is None:
            ignored.append(f"{op.kind} {op.number}")
            continue
        if op.kind == "EDIT":
            out[index] = Rule(task_type, op.text, rule.votes + 1)
        elif op.kind == "AGREE":
            out[index] = Rule(task_type, rule.text, rule.votes + 1)
        else:
            votes = rule.votes - 1
            out[index] = Rule(task_type, rule.text, votes) if votes > 0 else None
    return tuple(r for r in out if r is not None), ignored


def numbered_rules(rules: Sequence[Rule]) -> str:
    return "\n".join(f"{i}. {r.text}" for i, r in enumerate(rules, 1)) or "(none yet)"


def extraction_prompt(
    task_type: str, pairs: Sequence[tuple[Attempt, Attempt]], rules: Sequence[Rule]
) -> str:
    shown = "\n".join(
        template("insights_pair").format(number=i, failed=failed.text(), won=won.text())
        for i, (failed, won) in enumerate(pairs, 1)
    )
    return template("insights").format(
        task_type=task_type, pairs=shown.rstrip("\n"), rules=numbered_rules(rules)
    )


@dataclass(frozen=True)
class ExtractionStep:
    """One extraction call and what it did to the rule list."""

    task_type: str
    games: tuple[str, ...]
    prompt: str
    answer: str
    applied: tuple[str, ...]
    ignored: tuple[str, ...]
    rules_after: int
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, object]:
        return {
            "task_type": self.task_type,
            "games": list(self.games),
            "prompt": self.prompt,
            "answer": self.answer,
            "applied": list(self.applied),
            "ignored": list(self.ignored),
            "rules_after": self.rules_after,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def pairs_by_type(attempts: Sequence[Attempt]) -> dict[str, list[tuple[Attempt, Attempt]]]:
    """Per task type, each task's last failed attempt with its won one (tasks with both)."""
    out: dict[str, list[tuple[Attempt, Attempt]]] = {}
    games = sorted({a.game for a in attempts})
    for game in games:
        mine = sorted((a for a in attempts if a.game == game), key=lambda a: a.trial)
        failed = [a for a in mine if not a.won]
        won = [a for a in mine if a.won]
        if failed and won:
            out.setdefault(won[0].task_type, []).append((failed[-1], won[0]))
    return out


async def extract(
    model: ModelPort,
    attempts: Sequence[Attempt],
    *,
    max_tokens: int = 256,
    seed: int | None = 0,
    batch: int = BATCH_TASKS,
) -> tuple[tuple[Rule, ...], list[ExtractionStep]]:
    """The rule list made from ``attempts`` (module docstring), and every call that made it.
    Raises the backend's error."""
    rules: tuple[Rule, ...] = ()
    steps: list[ExtractionStep] = []
    for task_type, pairs in sorted(pairs_by_type(attempts).items()):
        for start in range(0, len(pairs), batch):
            chunk = pairs[start : start + batch]
            own = [r for r in rules if r.task_type == task_type]
            prompt = extraction_prompt(task_type, chunk, own)
            completion = await model.generate(
                Request(
                    # one operation a line: no stop at a newline
                    config=GenerationConfig(
                        temperature=0.0, max_tokens=max_tokens, stop=(), seed=seed
                    ),
                    prompt=prompt,
                    purpose="insights",
                    site=CallSite(game=chunk[0][1].game),
                )
            )
            ops, bad_lines = parse_ops(completion.text)
            rules, bad_ops = apply_ops(rules, task_type, ops)
            steps.append(
                ExtractionStep(
                    task_type,
                    tuple(won.game for _, won in chunk),
                    prompt,
                    completion.text,
                    tuple(f"{o.kind} {o.number or ''}".strip() for o in ops),
                    tuple(bad_lines + bad_ops),
                    len(rules),
                    completion.prompt_tokens,
                    completion.completion_tokens,
                )
            )
    return rules, steps


class Insights(ReflexionWindow):
    """Reflexion, with the rules in scope above the prompt."""

    uses_experience = "rules"  # a run of this arm needs experience_from, with its rules

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        return with_rules(super().recall(settings, past, task, trial), past)


def with_rules(shown: Recall, past: PastTrials) -> Recall:
    """``shown`` with the rules in scope of the run's experience above the prompt (if any)."""
    if past.experience is None:
        return shown
    return replace(shown, rules=past.experience.rules_for(past.task_type))


INSIGHTS = Insights()


ARMS = (
    Arm(
        "insights",
        build_react,
        INSIGHTS,
        "rules from another run (--experience-from)",
        section="experience",
        settings=ExperienceConfig,
    ),
)
