"""Offline generator of new ALFWorld games in the ``$ALFWORLD_DATA`` layout.

``generate(out, per_type=, seed=)`` samples tasks of ALFWorld's six types in ALFRED's floor plans
(as shipped with the alfworld package), checks each with the PDDL planner, replays the plan
through :class:`envs.alfworld_env.ALFWorldEnv` to a win, and writes
``json_2.1.1/<split>/<task folder>/<trial>/{game.tw-pddl,traj_data.json}``. alfworld and
textworld are imported only when a game is made.

Each game is drawn from ALFWorld's train-split statistics (``train_stats.json``: rooms, receptacle
lists, (type, object, receptacle) combinations, target copies, start placements; see
:mod:`envs.alfgen.tasks`); :mod:`envs.alfgen.stats` counts the same figures for any game folder
(``reflexsim games stats DIR``).

Contamination: placements, targets and trial ids are drawn fresh from the seed (nothing is
copied from ALFWorld's game files), and games for ``train`` / ``eval_in_distribution`` use only the
rooms of ALFWorld's train split, never the four ALFRED rooms of its ``eval_out_of_distribution``
split (``UNSEEN_EVAL_SCENES``); games for that split use only those rooms.
"""

from envs.alfgen.generator import GameFiles, GameMaker, generate
from envs.alfgen.scenes import UNSEEN_EVAL_SCENES

# Bumped whenever the same seed makes different games: caches of generated games are kept per
# version (2: drawn from the train split's statistics).
GENERATOR_VERSION = 2

__all__ = ["GENERATOR_VERSION", "UNSEEN_EVAL_SCENES", "GameFiles", "GameMaker", "generate"]
