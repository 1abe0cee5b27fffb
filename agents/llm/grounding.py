"""Grounded action decoding: one constraint, written in each engine's grammar language, and the
``nearest`` mapping of free output onto the admissible commands.

The language of an :class:`~agents.llm.base.ActionConstraint` ``c`` is

    c.lead ( A_1 | ... | A_n | "think: " T ) [ "\\n" ]

where ``A_i`` are ``c.actions`` verbatim, ``T`` is one or more characters other than a newline
(only when ``c.allow_think``), and the optional final newline (``newline=True``, used when the
request stops at ``"\\n"``) lets a model end its line the way it does under free decoding; the
backend's stop handling then drops it. Every backend builds its grammar here:
:func:`gbnf_for` (llama.cpp, in process and the server's ``grammar`` field), :func:`regex_for`
(vLLM structured outputs, in process and through ``vllm serve``), and :class:`TokenGrammar`
(token masks from :func:`viable_prefix`, behind the transformers logits processor).

:func:`nearest_action` is the ``nearest`` mode: free output mapped afterwards to the most similar
admissible command (see its docstring for the similarity).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence

from agents.llm.base import ActionConstraint

THINK = "think: "

# -- grammar builders ---------------------------------------------------------------------------

_GBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in _GBNF_ESCAPES:
            out.append(_GBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def gbnf_for(constraint: ActionConstraint, *, newline: bool = True) -> str:
    """A llama.cpp GBNF grammar (rule ``root``) for the constraint's language."""
    options = []
    if constraint.actions:
        options.append("action")
    if constraint.allow_think:
        options.append("think")
    tail = ' "\\n"?' if newline else ""
    lines = [f"root ::= {gbnf_literal(constraint.lead)} ({' | '.join(options)}){tail}"]
    if constraint.actions:
        # one literal per command; duplicates are harmless but make the grammar longer
        unique = list(dict.fromkeys(constraint.actions))
        lines.append("action ::= " + " | ".join(gbnf_literal(a) for a in unique))
    if constraint.allow_think:
        lines.append(f"think ::= {gbnf_literal(THINK)} [^\\n]+")
    return "\n".join(lines) + "\n"


_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")
_REGEX_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def regex_literal(text: str) -> str:
    """``text`` as a regular expression matching it exactly.

    Only the metacharacters are escaped (and newline, return, tab), so the pattern reads the same
    in Python's ``re`` and in the regex dialects of vLLM's structured-output engines (xgrammar,
    guidance, outlines), which do not all accept Python's escapes of ordinary characters.
    """
    return "".join(_REGEX_ESCAPES.get(ch, "\\" + ch if ch in _REGEX_SPECIAL else ch) for ch in text)


def regex_for(constraint: ActionConstraint, *, newline: bool = True) -> str:
    """A regular expression (to match in full) for the constraint's language."""
    options = [regex_literal(a) for a in dict.fromkeys(constraint.actions)]
    if constraint.allow_think:
        options.append(regex_literal(THINK) + "[^\\n]+")
    tail = "\\n?" if newline else ""
    return f"{regex_literal(constraint.lead)}({'|'.join(options)}){tail}"


def viable_prefix(constraint: ActionConstraint, text: str, *, newline: bool = True) -> bool:
    """Whether ``text`` can still grow into a completion the constraint allows."""
    lead = constraint.lead
    if len(text) <= len(lead):
        return lead.startswith(text)
    if not text.startswith(lead):
        return False
    body = text[len(lead) :]
    if newline and body.endswith("\n"):
        return is_complete(constraint, text[:-1], newline=False)
    if constraint.allow_think and (THINK.startswith(body) or body.startswith(THINK)):
        return "\n" not in body
    return any(a.startswith(body) for a in constraint.actions)


def is_complete(constraint: ActionConstraint, text: str, *, newline: bool = True) -> bool:
    """Whether ``text`` is a whole completion the constraint allows (generation may stop)."""
    lead = constraint.lead
    if not text.startswith(lead):
        return False
    body = text[len(lead) :]
    if newline and body.endswith("\n"):
        body = body[:-1]
    if body in constraint.actions:
        return True
    return (
        constraint.allow_think
        and body.startswith(THINK)
        and len(body) > len(THINK)
        and "\n" not in body
    )


# -- nearest --------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[^\W\d_]+|\d+")
_THINK_HEAD = re.compile(r"think\s*:|think\s+", re.IGNORECASE)


def command_features(text: str) -> frozenset[str]:
    """The features :func:`nearest_action` compares: lowercase words and numbers, plus each
    number joined to the word before it (``"mug 1"``), so object numbers count with their
    object."""
    words = _TOKEN.findall(text.lower())
    joined = {
        f"{prev} {word}"
        for prev, word in zip(words, words[1:], strict=False)
        if word.isdigit() and not prev.isdigit()
    }
    return frozenset(words) | frozenset(joined)


def similarity(a: str, b: str) -> float:
    """Jaccard overlap of :func:`command_features` (1.0 = same features; 0.0 = none shared)."""
    fa, fb = command_features(a), command_features(b)
    union = fa | fb
    return len(fa & fb) / len(union) if union else 0.0


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _normal(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".!")


def nearest_action(text: str, admissible: Sequence[str], *, allow_think: bool = True) -> str:
    """Map free model output to an admissible command, or to a normalised thought.

    The first non-empty line is read. If it equals an admissible command up to case, spacing, a
    final period and a leading ``>`` the model echoed, that command is returned. Else a line
    starting with ``think:`` (or ``think``) is a thought, returned as ``think: <text>`` with its
    whitespace collapsed, when ``allow_think``. Else the command is the admissible one with the
    highest :func:`similarity` (Jaccard overlap of words, numbers and word-number pairs:
    ``take mug 1 from desk 2`` is nearer ``take mug 1 from desk 2`` than ``take mug 2 from desk
    1``), ties going to the earliest in ``admissible``. With no admissible command the line
    itself is returned. Never raises.
    """
    raw = _first_line(text if isinstance(text, str) else str(text))
    line = raw.lstrip(">").strip()
    commands = [str(a) for a in admissible]
    wanted = {_normal(raw), _normal(line)}
    for command in commands:
        if _normal(command) in wanted:
            return command
    head = _THINK_HEAD.match(line)
    if head:
        thought = " ".join(line[head.end() :].split())
        if allow_think and thought:
            return THINK + thought
        line = thought
    if not commands:
        return line
    scores = [similarity(line, command) for command in commands]
    best = max(range(len(commands)), key=lambda i: (scores[i], -i))
    return commands[best]


# -- token level (engines that mask logits themselves) ----------------------------------------


class TokenGrammar:
    """Which tokens may come next under a constraint, from the text each token adds.

    For engines without a grammar sampler of their own (transformers): the generated text so far
    is the concatenation of the tokens' texts, and a token is allowed when the text it leads to
    is still a :func:`viable_prefix`. ``token_texts[i]`` is the text token ``i`` adds after other
    text, or None for tokens that must never be produced under a constraint (special tokens,
    partial UTF-8 bytes); ``stop_ids`` are the end-of-sequence tokens, allowed once the text is
    complete.
    """

    def __init__(self, token_texts: Sequence[str | None], stop_ids: Sequence[int]) -> None:
        self.texts = list(token_texts)
        self.stop_ids = sorted(set(stop_ids))
        self.by_text: dict[str, list[int]] = {}
        for i, t in enumerate(self.texts):
            if t:
                self.by_text.setdefault(t, []).append(i)
        self._sorted = sorted(self.by_text)
        # free thought text: tokens without a newline, and tokens ending the line
        self.plain = [i for i, t in enumerate(self.texts) if t and "\n" not in t]
        self.line_end = [
            i for i, t in enumerate(self.texts) if t and t.endswith("\n") and "\n" not in t[:-1]
        ]
        self._free: dict[tuple[bool, bool], list[int]] = {}

    def _prefixes_of(self, remainder: str) -> list[int]:
        """Tokens whose text is a non-empty prefix of ``remainder``."""
        out: list[int] = []
        for k in range(1, len(remainder) + 1):
            out += self.by_text.get(remainder[:k], ())
        return out

    def _starting_with(self, head: str) -> list[str]:
        """Token texts that start with ``head`` and are longer than it."""
        lo = bisect.bisect_right(self._sorted, head)
        hi = bisect.bisect_left(self._sorted, head + "\U0010ffff")
        return [t for t in self._sorted[lo:hi] if t.startswith(head)]

    def allowed(
        self, constraint: ActionConstraint, text: str, *, newline: bool = True
    ) -> list[int]:
        """Token ids that may follow ``text`` (the completion so far); stop tokens included
        when ``text`` is already complete. Empty when ``text`` is not a viable prefix."""
        if not viable_prefix(constraint, text, newline=newline):
            return []
        out: list[int] = []
        if is_complete(constraint, text, newline=newline):
            out += self.stop_ids
        if text.endswith("\n") and newline and len(text) > len(constraint.lead):
            return out  # the line is over
        targets = [constraint.lead + a for a in constraint.actions]
        if newline:
            targets = [t + "\n" for t in targets]
        for target in targets:
            if target.startswith(text):
                out += self._prefixes_of(target[len(text) :])
        if constraint.allow_think:
            head = constraint.lead + THINK
            if head.startswith(text) and len(text) < len(head):
                rest = head[len(text) :]
                out += self._prefixes_of(rest)
                for t in self._starting_with(rest):
                    tail = t[len(rest) :]
                    ends_line = newline and len(tail) > 1 and tail.find("\n") == len(tail) - 1
                    if "\n" not in tail or ends_line:
                        out += self.by_text[t]
            elif text.startswith(head):
                return self.free_text(has_text=len(text) > len(head), newline=newline)
        return sorted(set(out))

    def free_text(self, *, has_text: bool, newline: bool) -> list[int]:
        """Tokens allowed inside a thought (the same list object for the same arguments, so a
        caller may cache what it builds from it): text without a newline, a line end once the
        thought has text (or a token that brings both), and the stop tokens once it has text."""
        key = (has_text, newline)
        if key not in self._free:
            out = list(self.plain)
            if newline:
                out += [i for i in self.line_end if has_text or len(self.texts[i] or "") > 1]
            if has_text:
                out += self.stop_ids
            self._free[key] = sorted(set(out))
        return self._free[key]
