"""ALFWorld (TextWorld-PDDL) games behind ``gymnasium.Env[str, str]``.

The one module that adapts ALFWorld's engine: TextWorld's (state, score, done) becomes
Gymnasium's 5-tuple here and nowhere else. One engine per env, reused across games.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gymnasium as gym

from envs.discovery import TASK_TYPES, GameRecord, discover_games
from envs.errors import EnvError, GameFileError
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, pick_game, printable, text_space

BANNER = "-= Welcome to TextWorld, ALFRED! =-"
TASK_PREFIX = "Your task is to: "


def strip_banner(feedback: str) -> str:
    """Drop everything up to the first blank line, as both original codes do."""
    if feedback.lstrip().startswith("-="):
        _, _, rest = feedback.partition("\n\n")
        return rest
    return feedback


def task_sentence(observation: str) -> str:
    for line in observation.splitlines():
        if line.startswith(TASK_PREFIX):
            return line[len(TASK_PREFIX) :].strip()
    return ""


def _forget_propositions() -> None:
    """Empty TextWorld's global cache of interned Propositions.

    TextWorld keeps every Proposition it ever builds; ALFWorld names objects uniquely per game,
    so an env's memory would grow with every game it loads (259 MB after 140 games instead of
    ~100). Propositions compare and hash by value, so dropping them changes no result.
    """
    from mementos import core
    from textworld.logic import Proposition

    cache = getattr(core, "_memento_cache", None)
    if isinstance(cache, dict):
        for key in [k for k in cache if isinstance(k, tuple) and k and k[0] is Proposition]:
            del cache[key]


def _make_engine() -> Any:
    """A TextWorld PddlEnv that names entities as ALFWorld does and translates once per reset."""
    import textworld

    # importing alfworld sets $ALFWORLD_DATA (to ~/.cache/alfworld) when it is unset, which would
    # silently change where later envs and runs look for games: undo that
    saved = os.environ.get("ALFWORLD_DATA")
    try:
        from alfworld.agents.utils.misc import Demangler
    finally:
        if saved is None:
            os.environ.pop("ALFWORLD_DATA", None)
    from textworld.core import GameState
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic

    class Engine(PddlEnv):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(textworld.EnvInfos(admissible_commands=True, won=True, feedback=True))
            self._fresh = False

        def load(self, data: Any) -> None:
            _forget_propositions()
            super().load(data)
            demangler = Demangler(game_infos=self._entity_infos, shuffle=False)
            for info in self._entity_infos.values():
                info.name = demangler.demangle_alfred_name(info.id)
            self._fresh = True

        def reset(self) -> Any:
            # load() already translated the problem: reuse that state once instead of paying
            # fast-downward's translation twice for the first episode of a game.
            if not self._fresh:
                self._pddl_state = pddl_logic.PddlState(
                    self.downward_lib, self._game_data["pddl_problem"], self._logic
                )
            self._fresh = False
            self.prev_state = None
            self.state = GameState()
            self._last_action = None
            self._moves = 0
            context = {
                "state": self._pddl_state,
                "facts": list(self._pddl_state.facts),
                "variables": {},
                "mapping": {},
                "entity_infos": self._entity_infos,
            }
            self.state.feedback = self._logic.grammar.derive("#intro#", context)
            self.state.raw = self.state.feedback
            self._gather_infos()
            return self.state

        def step(self, command: str) -> Any:
            self._fresh = False
            return super().step(command)

    return Engine()


def load_game_data(path: Path) -> dict[str, Any]:
    """Read and check a ``game.tw-pddl`` file; a clear error instead of a deep traceback."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GameFileError(f"game file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GameFileError(
            f"game file {str(path)!r} is not valid JSON ({exc.__class__.__name__}): re-download or regenerate it"
        ) from None
    missing = [
        k
        for k in ("pddl_domain", "grammar", "pddl_problem")
        if not isinstance(data, dict) or k not in data
    ]
    if missing:
        raise GameFileError(
            f"game file {str(path)!r} lacks {', '.join(missing)}: it is not an ALFWorld game"
        )
    return data


class ALFWorldEnv(gym.Env[str, str]):
    """ALFWorld household games: ``reset(options={"game": id})`` picks one explicitly.

    ``info`` carries ``admissible_commands``, ``won``, ``task``, ``task_type`` (short name: put,
    clean, heat, cool, examine, puttwo), ``game``, ``max_steps``, ``walkthrough`` (if known).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        split: str = "eval_out_of_distribution",
        task_types: list[str | int] | None = None,
        max_steps: int = 50,
        games: list[str] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if max_steps <= 0:
            raise EnvError(f"max_steps must be > 0, got {max_steps}")
        records = discover_games(data_dir, split, task_types)
        if games is not None:
            by_id = {r.game_id: r for r in records}
            unknown = [g for g in games if g not in by_id]
            if unknown:
                raise EnvError(f"unknown game id {unknown[0]!r} in split {split!r}")
            records = [by_id[g] for g in games]
        self._records: dict[str, GameRecord] = {r.game_id: r for r in records}
        self.game_ids: list[str] = sorted(self._records)
        self.max_steps = max_steps
        self.render_mode = render_mode
        self.observation_space = text_space(MAX_OBSERVATION)
        self.action_space = text_space(MAX_ACTION)
        self._engine: Any = None
        self._loaded: str | None = None
        self._game: GameRecord | None = None
        self._walkthrough: list[str] | None = None
        self._task = ""
        self._steps = 0
        self._last_obs = ""
        self._last_admissible: list[str] = []

    # -- gymnasium API -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        game_id = pick_game(options, self.game_ids, self.np_random)
        record = self._records[game_id]
        if self._engine is None:
            self._engine = _make_engine()
        if self._loaded != game_id:
            data = load_game_data(record.path)
            try:
                self._engine.load(data)
            except (Exception, SystemExit) as exc:
                # the engine's own parse errors are deep, cryptic and multi-line; fast-downward's
                # translator even raises SystemExit on a bad problem
                self._loaded = None
                detail = " ".join(str(exc).split())[:120]
                raise GameFileError(
                    f"game file {str(record.path)!r} could not be loaded ({exc.__class__.__name__}: {detail}): re-download or regenerate it"
                ) from exc
            self._loaded = game_id
            self._walkthrough = list(data["walkthrough"]) if data.get("walkthrough") else None
        state = self._engine.reset()
        self._game = record
        self._steps = 0
        obs = printable(strip_banner(state.feedback))
        self._task = task_sentence(obs)
        self._last_obs = obs
        return obs, self._info(state)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._game is None:
            raise RuntimeError("call reset() before step()")
        state, _, _ = self._engine.step(str(action))
        self._steps += 1
        won = bool(state["won"])
        obs = printable(state.feedback)
        self._last_obs = obs
        reward = 1.0 if won else 0.0
        truncated = (not won) and self._steps >= self.max_steps
        return obs, reward, won, truncated, self._info(state)

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last_obs
        return None

    def close(self) -> None:
        self._engine = None
        self._loaded = None

    # -- helpers -------------------------------------------------------------------------
    def _info(self, state: Any) -> dict[str, Any]:
        assert self._game is not None
        self._last_admissible = list(state["admissible_commands"])
        info: dict[str, Any] = {
            "admissible_commands": self._last_admissible,
            "won": bool(state["won"]),
            "task": self._task,
            "task_type": TASK_TYPES[self._game.task_type],
            "alfworld_task_type": self._game.task_type,
            "game": self._game.game_id,
            "game_file": str(self._game.path),
            "max_steps": self.max_steps,
            "steps": self._steps,
        }
        if self._walkthrough is not None:
            info["walkthrough"] = list(self._walkthrough)
        return info
