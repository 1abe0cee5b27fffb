"""A run's ground truth read from its game files: the implementation of
:class:`agents.llm.ground_truth.GroundTruth` the runner hands to the privileged readers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from envs import alfworld_env, textworld_env


class GameFileTruth:
    """Each game's walkthrough, read from its file without playing it (once per game)."""

    def __init__(self, env_kind: str, files: Mapping[str, Path]) -> None:
        self.env_kind = env_kind  # "alfworld" | "textworld"
        self.files = dict(files)
        self._read: dict[str, list[str] | None] = {}

    def walkthrough(self, game: str) -> list[str] | None:
        if game not in self._read:
            path = self.files.get(game)
            self._read[game] = None if path is None else self._from_file(path)
        found = self._read[game]
        return list(found) if found else None

    def _from_file(self, path: Path) -> list[str] | None:
        env = textworld_env if self.env_kind == "textworld" else alfworld_env
        return env.game_walkthrough(path)
