"""ALFWorld (TextWorld-PDDL) games behind ``gymnasium.Env[str, str]``.

The one module that adapts ALFWorld's engine: TextWorld's (state, score, done) becomes
Gymnasium's 5-tuple here and nowhere else. One engine per env, reused across games.

Fast steps (``fast_text=True``, the default). TextWorld's ``PddlEnv`` spends ~90% of a step
deriving text from the game's grammar: the observation and the command of every applicable
action, each derivation re-parsing strings with TatSu and deep-copying contexts. The engine runs
TextWorld's own ``reset``/``step``/``_gather_infos`` unchanged but hands them a grammar whose
``derive`` comes from :mod:`envs.fast_text`: strings parsed once, contexts shared instead of
copied, and each derivation's text memoized with the fact signatures it read (the state counts
changes per signature), so commands like ``open drawer 1`` or ``go to cabinet 1`` are derived
once per game. Exact by construction: the same rules are chosen by the state's own
``all_assignments``, the same expressions evaluated (only side-effect-free ones; anything else
goes to TextWorld's grammar), and a memoized text is reused only while everything it read is
unchanged. ``fast_text=False`` uses TextWorld's grammar throughout, to check equality any time.

Cheap resets (``reset_cache``). Building a game's state runs fast-downward's translation of the
PDDL problem (twice: one for play, one for replanning), 0.2-0.8 s a game. The process keeps, for
the ``reset_cache`` games its engines loaded last, the parsed logic, the named entities and the
translation (task, SAS texts and the facts the state started with, ~4 MB a game); a reset of
one of them, by any engine of the process, loads the same SAS into that engine's fast-downward
and adds the same facts in the same order, so the state is equal to a freshly translated one,
iteration orders included, without translating. The cache is the process's, not an engine's:
an env worker keeps an engine per slot it serves, and a game's next trial seldom lands on the
slot that played the last one. (Engines share a game's grammar memo too: a memoized text is
keyed by the versions of the facts it read, which are unique in the process.) Replaying ``d``
actions after such a reset costs ``d`` steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym

from envs import DEFAULT_RESET_CACHE
from envs.discovery import TASK_TYPES, GameRecord, discover_games
from envs.errors import EnvError, GameFileError
from envs.fast_text import (
    FastGrammar,
    Translation,
    recording_state_class,
    restore_state,
    tracked_state_class,
)
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, pick_game, printable, text_space
from envs.translations import TranslationStore

log = logging.getLogger(__name__)

BANNER = "-= Welcome to TextWorld, ALFRED! =-"
TASK_PREFIX = "Your task is to: "


def strip_banner(feedback: str) -> str:
    """The reset text as both original codes take it: ``'\\n'.join(ob.split('\\n\\n')[1:])``.

    The banner paragraph goes, and the paragraphs left are joined by one newline (not a blank
    line): "You are in the middle of a room. ...\\nYour task is to: ...". A text without the
    banner is left as it is."""
    if feedback.lstrip().startswith("-="):
        return "\n".join(feedback.split("\n\n")[1:])
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
    # heavy: textworld, only to play or make a game
    from mementos import core
    from textworld.logic import Proposition

    cache = getattr(core, "_memento_cache", None)
    if isinstance(cache, dict):
        for key in [k for k in cache if isinstance(k, tuple) and k and k[0] is Proposition]:
            del cache[key]


@dataclass(frozen=True)
class _Game:
    """A loaded game as an engine keeps it: parsed logic, named entities, its translation."""

    logic: Any
    entity_infos: dict[str, Any]
    translation: Translation | None  # None: every reset translates the problem again


# The games this process's engines loaded last (least recently loaded first), by (fast_text,
# content): shared by every engine of the process, at most its engines' ``reset_cache``.
_LOADED: OrderedDict[tuple[bool, str], _Game] = OrderedDict()


def _game_key(data: dict[str, Any]) -> str:
    """Names a game by its content, so one game under two paths is one cache entry."""
    digest = hashlib.sha256()
    for part in ("pddl_domain", "grammar", "pddl_problem"):
        digest.update(str(data[part]).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


def _make_engine(
    fast_text: bool = True,
    reset_cache: int = DEFAULT_RESET_CACHE,
    translations: TranslationStore | None = None,
) -> Any:
    """A TextWorld PddlEnv that names entities as ALFWorld does and translates each game once.

    ``fast_text``: derive text with :class:`envs.fast_text.FastGrammar` (else TextWorld's own
    grammar); ``reset_cache``: how many games' translations to keep (0: translate every reset);
    ``translations``: where a game loaded here for the first time finds its translation, or
    leaves it (with ``reset_cache`` > 0).
    """
    import textworld  # heavy: textworld, only to play or make a game

    # importing alfworld sets $ALFWORLD_DATA (to ~/.cache/alfworld) when it is unset, which would
    # silently change where later envs and runs look for games: undo that
    saved = os.environ.get("ALFWORLD_DATA")
    try:
        # heavy: alfworld, only to play or make a game
        from alfworld.agents.utils.misc import Demangler
    finally:
        if saved is None:
            os.environ.pop("ALFWORLD_DATA", None)
    # heavy: textworld, only to play or make a game
    from textworld.core import GameState
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic

    if fast_text:
        state_class = tracked_state_class()
    elif reset_cache:
        state_class = recording_state_class()
    else:
        state_class = pddl_logic.PddlState

    class Engine(PddlEnv):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(textworld.EnvInfos(admissible_commands=True, won=True, feedback=True))
            self._fresh = False
            self._current: _Game | None = None

        def load(self, data: Any) -> None:
            """PddlEnv.load for game data, with ALFWorld's names; a game in the process's cache
            is not re-parsed nor re-translated."""
            _forget_propositions()
            key = (fast_text, _game_key(data))
            game = _LOADED.get(key) if reset_cache else None
            if game is not None:
                _LOADED.move_to_end(key)
                assert game.translation is not None
                self._pddl_state = restore_state(state_class, game.translation, self.downward_lib)
            else:
                domain, problem = data["pddl_domain"], data["pddl_problem"]
                logic = pddl_logic.GameLogic(domain=domain, grammar=data["grammar"])
                translation = self._first_state(logic, domain, problem)
                infos = self._get_entity_infos()
                demangler = Demangler(game_infos=infos, shuffle=False)
                for info in infos.values():
                    info.name = demangler.demangle_alfred_name(info.id)
                if fast_text:
                    logic.grammar = FastGrammar(logic.grammar, infos)
                if translation is None and reset_cache:
                    translation = Translation.of(self._pddl_state)
                    if translations is not None:
                        translations.put(domain, problem, translation.stored())
                game = _Game(logic, infos, translation)
                if reset_cache:
                    _LOADED[key] = game
                    while len(_LOADED) > reset_cache:
                        _LOADED.popitem(last=False)
            self._game_file = None
            self._game_data = data
            self.walkthrough = data.get("walkthrough", None)
            self._current = game
            self._logic = game.logic
            self._entity_infos = game.entity_infos
            self._fresh = True

        def _first_state(self, logic: Any, domain: str, problem: str) -> Translation | None:
            """Build a newly loaded game's state: from its translation on disk when there is a
            usable one (returned), else by translating (None). An entry of the right name but
            not of a translation's layout is logged and translated instead."""
            if translations is not None and reset_cache:
                stored = translations.get(domain, problem)
                if stored is not None:
                    try:
                        translation = Translation.from_stored(stored, logic)
                        self._pddl_state = restore_state(
                            state_class, translation, self.downward_lib
                        )
                        return translation
                    except Exception as exc:
                        log.warning("translation cache: an entry could not be used (%r)", exc)
            self._pddl_state = state_class(self.downward_lib, problem, logic)
            return None

        def reset(self) -> Any:
            # load() already built the state: use it once instead of translating (or restoring)
            # the problem a second time for the first episode of a game.
            if not self._fresh:
                assert self._current is not None
                if self._current.translation is not None:
                    self._pddl_state = restore_state(
                        state_class, self._current.translation, self.downward_lib
                    )
                else:
                    self._pddl_state = state_class(
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


def game_walkthrough(path: Path) -> list[str] | None:
    """The walkthrough a ``game.tw-pddl`` file carries (None without one), read without playing."""
    walkthrough = load_game_data(path).get("walkthrough")
    return [str(a) for a in walkthrough] if walkthrough else None


class ALFWorldEnv(gym.Env[str, str]):
    """ALFWorld household games: ``reset(options={"game": id})`` picks one explicitly.

    ``info`` carries ``admissible_commands``, ``won``, ``task``, ``task_type`` (short name: put,
    clean, heat, cool, examine, puttwo), ``game``, ``game_file``, ``max_steps``, ``steps``; never
    the walkthrough (ground truth: :func:`game_walkthrough` reads it from the game file).

    ``fast_text=False`` derives all text with TextWorld's own grammar code (same text, ~10-50x
    slower steps); ``reset_cache`` is how many games' translated problems the process keeps (for
    all its envs), so that a reset of one of them skips fast-downward's translation (0: this
    env translates every reset); ``translation_cache`` is the directory where a game's
    translation is kept for every later process (:mod:`envs.translations`; used with
    ``reset_cache`` > 0; None, the default here: none; a run's workers use
    ``~/.cache/reflexsim/alfworld-translations`` unless ``--translation-cache`` says otherwise).
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
        fast_text: bool = True,
        reset_cache: int = DEFAULT_RESET_CACHE,
        translation_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_steps <= 0:
            raise EnvError(f"max_steps must be > 0, got {max_steps}")
        if isinstance(reset_cache, bool) or not isinstance(reset_cache, int) or reset_cache < 0:
            raise EnvError(
                f"reset_cache must be a whole number >= 0 (0 turns the cache off), got {reset_cache!r}"
            )
        self.fast_text = bool(fast_text)
        self.reset_cache = reset_cache
        self.translations = (
            None if translation_cache is None else TranslationStore(translation_cache)
        )
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
            self._engine = _make_engine(self.fast_text, self.reset_cache, self.translations)
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

    def text_stats(self) -> dict[str, int]:
        """The current game's text derivations so far: ``hits`` and ``misses`` of the memo,
        ``fallbacks`` to TextWorld's grammar. Empty with ``fast_text=False`` or before a reset."""
        grammar = getattr(getattr(self._engine, "_logic", None), "grammar", None)
        if not isinstance(grammar, FastGrammar):
            return {}
        deriver = grammar.deriver
        return {"hits": deriver.hits, "misses": deriver.misses, "fallbacks": grammar.fallbacks}

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
        return info
