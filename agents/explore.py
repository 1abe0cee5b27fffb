"""Exploration memory: what each place held, read from the observations of earlier trials."""

from __future__ import annotations

import re
from collections.abc import Iterable

from memory.records import ExplorationFact, Step, StepKind

# "You arrive at drawer 1. On the drawer 1, you see a pen 1, and a cd 2."
# "You open the drawer 1. The drawer 1 is open. In it, you see nothing."
_SEEN = re.compile(r"(?:On|In) (?:the )?(?:[\w ]+?\d+|it), you see (?P<items>[^.]*)\.")
_PLACE = re.compile(r"^(?:go to|open) (?P<place>.+)$")


def _items(text: str) -> tuple[str, ...]:
    if text.strip() == "nothing":
        return ()
    parts = re.split(r",\s*(?:and\s+)?|\s+and\s+", text)
    out = []
    for p in parts:
        p = p.strip()
        for art in ("a ", "an ", "some "):
            if p.startswith(art):
                p = p[len(art) :]
        if p:
            out.append(p)
    return tuple(out)


def extract_facts(steps: Iterable[Step], trial: int) -> list[ExplorationFact]:
    """Places visited or opened and what was seen in them (only where the contents were shown)."""
    facts: dict[str, ExplorationFact] = {}
    for s in steps:
        if s.kind != StepKind.ACT:
            continue
        m = _PLACE.match(s.action)
        if not m:
            continue
        seen = _SEEN.search(s.observation)
        if not seen:
            continue
        place = m.group("place")
        facts[place] = ExplorationFact(
            place=place,
            contents=_items(seen.group("items")),
            trial=trial,
            opened=s.action.startswith("open "),
        )
    return list(facts.values())
