"""Turn a model's raw text into one step: a thought, an action, or nothing valid.

Model output is untrusted: no string makes this raise (property-tested).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memory.records import StepKind

_PUT = re.compile(r"^put (?P<obj>.+?) (?:in/on|in|on|into|onto) (?P<recep>.+)$")
_THINK = re.compile(r"^think\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class GroundingRules:
    """Optional rewrites of the model's action before it reaches the env."""

    put_to_move: bool = True  # ALFWorld <0.4 `put X in/on Y` -> 0.4 `move X to Y`
    lowercase: bool = True
    strip_prompt_marks: bool = True  # a stray leading '>' the model echoed

    @classmethod
    def none(cls) -> GroundingRules:
        return cls(put_to_move=False, lowercase=False, strip_prompt_marks=False)


@dataclass(frozen=True)
class ParsedAction:
    kind: StepKind
    raw: str  # the model's text as received
    action: str  # what is executed (or, for a thought, the thought line)
    rules: tuple[str, ...] = ()  # grounding rules that changed the text


def parse_action(raw: str, rules: GroundingRules = GroundingRules()) -> ParsedAction:
    """First non-empty line, stripped; ``think:`` lines are thoughts; grounding rules applied."""
    text = raw if isinstance(raw, str) else str(raw)
    line = ""
    for candidate in text.splitlines():
        if candidate.strip():
            line = candidate.strip()
            break
    applied: list[str] = []
    if rules.strip_prompt_marks and line.startswith(">"):
        line = line.lstrip("> ").strip()
        applied.append("strip_prompt_marks")
    if not line:
        return ParsedAction(StepKind.INVALID, text, "", tuple(applied))
    if _THINK.match(line):
        thought = line.split(":", 1)[1].strip()
        return ParsedAction(StepKind.THINK, text, f"think: {thought}", tuple(applied))
    if rules.lowercase and line != line.lower():
        line = line.lower()
        applied.append("lowercase")
    if rules.put_to_move:
        moved = put_to_move(line)
        if moved != line:
            line = moved
            applied.append("put_to_move")
    line = " ".join(line.split())
    return ParsedAction(StepKind.ACT, text, line, tuple(applied))


def put_to_move(action: str) -> str:
    """ALFWorld < 0.4's ``put X in/on Y`` as 0.4's ``move X to Y``; any other action as it is."""
    m = _PUT.match(action)
    return f"move {m.group('obj')} to {m.group('recep')}" if m else action


def was_mapped(raw_output: str, action: str) -> bool:
    """Whether an executed command is neither what the model wrote nor its rewrite by the
    grounding rules: a command that ``nearest`` decoding chose for it. Viewers mark such steps."""
    if not action:
        return False
    written = {
        parse_action(raw_output, rules).action
        for rules in (GroundingRules.none(), GroundingRules())
    }
    return action not in written


STILL_VERBS = ("look", "inventory", "examine")  # commands that change nothing in the game
RECEPTACLE_VERBS = ("open", "close")


def verb_target(action: str) -> tuple[str, str]:
    """('go', 'desk 1') for 'go to desk 1'; (first word, the words after it) otherwise."""
    words = action.split()
    if not words:
        return "", ""
    if words[0] == "go" and len(words) > 1 and words[1] == "to":
        return "go", " ".join(words[2:])
    return words[0], " ".join(words[1:])
