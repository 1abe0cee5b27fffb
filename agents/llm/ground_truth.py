"""The one port to a game's ground truth: its walkthrough (a list of commands that wins it).

Privileged: only scripted policies (:mod:`agents.llm.scripted`, built with a
:class:`GroundTruth`) and the LATS ``oracle`` value read it, through this port. Requests,
episode records and the trial loop never carry it, and a real model never sees it. A run's ground
truth is read from its game files (:class:`envs.ground_truth.GameFileTruth`), so a resumed run's
fresh backend answers as the first one did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class GroundTruth(Protocol):
    def walkthrough(self, game: str) -> list[str] | None:
        """The game's walkthrough, or None when it has none (or the game is unknown)."""
        ...


@dataclass(frozen=True)
class Walkthroughs:
    """Ground truth from a mapping (game id -> walkthrough); empty: no game has one."""

    by_game: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def walkthrough(self, game: str) -> list[str] | None:
        walkthrough = self.by_game.get(game)
        return [str(a) for a in walkthrough] if walkthrough else None


NO_GROUND_TRUTH = Walkthroughs()
