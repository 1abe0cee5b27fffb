"""A game's walkthrough for tests, read through the ground-truth port (the env never replies with it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envs.ground_truth import GameFileTruth


def walkthrough_of(info: Mapping[str, Any]) -> list[str]:
    """The walkthrough of the game an env reply is about, read from its game file by
    :class:`GameFileTruth`; a game without one fails the test."""
    kind = "textworld" if info["task_type"] == "textworld" else "alfworld"
    game = str(info["game"])
    found = GameFileTruth(kind, {game: Path(info["game_file"])}).walkthrough(game)
    assert found, f"game {game} has no walkthrough in {info['game_file']}"
    return found
