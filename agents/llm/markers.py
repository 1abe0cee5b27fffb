"""Fixed strings of the rendered prompts and transcripts that other parts may rely on (the
scripted policies among them)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# The first line of the memory block in the actor prompt.
MEMORY_MARKER = "Your memory for the task below:"

# A plan step of Plan-and-Execute on one transcript line (see :func:`render_plan`).
PLAN_PREFIX = "think: Plan: "
REPLAN_PREFIX = "think: Revised plan for the remaining steps: "
NO_PLAN = "(no plan)"
_RENDERED_ITEM = re.compile(r"^\d+\)\s*")


def render_plan(items: Sequence[str]) -> str:
    """A plan on one transcript line: ``1) go to desk 1; 2) take pen 1 from desk 1``."""
    return "; ".join(f"{i}) {a}" for i, a in enumerate(items, 1)) or NO_PLAN


def plan_items(action: str) -> list[str]:
    """The actions of a recorded plan step (its ``action`` text), in order."""
    for prefix in (REPLAN_PREFIX, PLAN_PREFIX):
        if action.startswith(prefix):
            body = action[len(prefix) :]
            if body == NO_PLAN:
                return []
            return [_RENDERED_ITEM.sub("", part).strip() for part in body.split("; ")]
    return []


# The first line of the block of learned rules at the top of an actor prompt
# (agents/prompts/rules_block.txt), and the line of a rule-extraction prompt that names the
# task type of its attempts (agents/prompts/insights.txt).
RULES_MARKER = "Rules learned on earlier tasks:"
# What the game's first observation says the task is after (ALFWorld's wording).
TASK_LINE = "Your task is to:"
TASK_TYPE_LINE = "Task type: "
