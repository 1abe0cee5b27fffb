"""Text spaces shared by the envs: printable charset, empty strings allowed."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from gymnasium import spaces

from envs.errors import EnvError

CHARSET = frozenset(string.printable)
MAX_OBSERVATION = 65536
MAX_ACTION = 4096


def text_space(max_length: int) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=string.printable)


def printable(text: str, limit: int = MAX_OBSERVATION) -> str:
    """Make an observation fit the space: non-printable characters become '?'."""
    if all(c in CHARSET for c in text):
        return text[:limit]
    return "".join(c if c in CHARSET else "?" for c in text)[:limit]


def pick_game(options: dict[str, Any] | None, game_ids: Sequence[str], np_random: Any) -> str:
    """The game a reset plays: ``options["game"]``, else one the env's seeded RNG picks."""
    game_id = (options or {}).get("game")
    if game_id is None:
        return game_ids[int(np_random.integers(len(game_ids)))]
    if game_id not in game_ids:
        raise EnvError(
            f"unknown game id {game_id!r}: env.game_ids lists the {len(game_ids)} games of this env"
        )
    return str(game_id)
