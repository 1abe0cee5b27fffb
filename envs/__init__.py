"""Household text games behind Gymnasium: ALFWorld (TextWorld-PDDL) and TextWorld (z-machine).

``ENV_KINDS`` is the one table of the project's envs: importing this package registers each with
Gymnasium under its id, and the env pool builds them by kind name. It imports neither alfworld
nor textworld (the adapters import them lazily); of the project, only memory's records (EnvReply).
"""

from dataclasses import dataclass

import gymnasium as gym

from envs.discovery import SPLITS, TASK_TYPES, GameRecord, discover_games
from envs.errors import EnvError, GameFileError


@dataclass(frozen=True)
class EnvKind:
    """One env: its Gymnasium id and its constructor ("module:callable")."""

    gym_id: str
    entry_point: str


# ALFWorld games whose translation an env keeps for cheap resets. Each costs ~4 MB: one env's RSS
# after 140 valid_seen games is ~110 MB without the cache and ~175 MB with 16 games in it.
DEFAULT_RESET_CACHE = 8

# Env kinds a pool spec may name (any other kind is a "module:callable" returning a gymnasium.Env).
ENV_KINDS: dict[str, EnvKind] = {
    "alfworld": EnvKind("reflexsim/ALFWorld-v0", "envs.alfworld_env:ALFWorldEnv"),
    "textworld": EnvKind("reflexsim/TextWorld-v0", "envs.textworld_env:TextWorldEnv"),
}

for _kind in ENV_KINDS.values():
    if _kind.gym_id not in gym.registry:
        gym.register(id=_kind.gym_id, entry_point=_kind.entry_point)

__all__ = [
    "ENV_KINDS",
    "SPLITS",
    "TASK_TYPES",
    "EnvError",
    "EnvKind",
    "GameFileError",
    "GameRecord",
    "discover_games",
]
