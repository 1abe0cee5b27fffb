"""Household text games behind Gymnasium: ALFWorld (TextWorld-PDDL) and TextWorld (z-machine).

Importing this package registers ``reflexsim/ALFWorld-v0`` and ``reflexsim/TextWorld-v0``; it
imports neither alfworld nor textworld (the adapters import them lazily). No project imports.
"""

import gymnasium as gym

from envs.discovery import SPLITS, TASK_TYPES, GameRecord, discover_games
from envs.errors import EnvError, GameFileError

if "reflexsim/ALFWorld-v0" not in gym.registry:
    gym.register(id="reflexsim/ALFWorld-v0", entry_point="envs.alfworld_env:ALFWorldEnv")
if "reflexsim/TextWorld-v0" not in gym.registry:
    gym.register(id="reflexsim/TextWorld-v0", entry_point="envs.textworld_env:TextWorldEnv")

__all__ = ["SPLITS", "TASK_TYPES", "EnvError", "GameFileError", "GameRecord", "discover_games"]
