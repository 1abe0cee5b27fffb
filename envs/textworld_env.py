"""TextWorld z-machine games (``.z8`` and its ``.json``) behind ``gymnasium.Env[str, str]``.

The one module that adapts TextWorld's Inform 7 games: TextWorld's (state, score, done) becomes
Gymnasium's 5-tuple here and nowhere else. One engine per env, reused across games: switching
games calls the engine's ``load()`` after shutting the interpreter down, because TextWorld's
``JerichoEnv.load`` alone leaks about 0.5 MiB per switch (see ``benchmarks/bench_textworld_engine.py``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import gymnasium as gym

from envs.errors import EnvError, GameFileError
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, pick_game, printable, text_space

TASK_TYPE = "textworld"
Z_EXTENSIONS = frozenset(f".z{v}" for v in range(1, 9))
# The interpreter's own RNG. Generated games seed theirs at start; this pins the rest.
# Jericho treats 0 as "no seed" (time-based), so it must be non-zero.
EMULATOR_SEED = 20180
# Interpreter commands that are not game actions: they open yes/no prompts, write files or reset
# the story behind the state tracker's back. ``tw-*`` are TextWorld's own debugging hooks.
META_COMMANDS = frozenset(
    {"quit", "q", "restart", "save", "restore", "script", "unscript", "noscript", "transcript"}
)
MAX_COMMAND = 190  # Jericho's input buffer holds 198 bytes
NOT_AVAILABLE = "That command is not available in this game."
GAME_OVER = "The game is over."
_END_PROMPT = re.compile(r"\s*Would you like to RESTART, RESTORE a saved game.*\Z", re.DOTALL)
_END_MARKER = re.compile(r"^[ \t]+(\*\*\* .* \*\*\*)[ \t]*$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{3,}")
_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_LETTER = re.compile(r"[A-Za-z]")


def clean_text(feedback: str) -> str:
    """Tidy the interpreter's text: no end-of-story prompt, no centring, at most one blank line."""
    text = _END_PROMPT.sub("", feedback)
    text = _END_MARKER.sub(r"\1", text)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return _BLANK_RUN.sub("\n\n", text).strip()


def strip_banner(feedback: str) -> str:
    """Drop TextWorld's ASCII-art title (the leading paragraphs without a letter in them)."""
    paragraphs = _PARAGRAPH.split(feedback.strip("\n"))
    while paragraphs and not _LETTER.search(paragraphs[0]):
        paragraphs.pop(0)
    return "\n\n".join(paragraphs)


def normalize_action(action: str) -> str:
    """One short ASCII line the interpreter reads as typed.

    A newline would queue a second command, a backslash starts one of Frotz's own escape
    commands (and can hang it), and Jericho cuts input at 198 bytes.
    """
    text = str(action).replace("\\", " ")
    text = "".join(c if " " <= c <= "~" else " " for c in text)
    return " ".join(text.split())[:MAX_COMMAND]


def is_meta_command(command: str) -> bool:
    words = command.lower().split()
    return bool(words) and (words[0] in META_COMMANDS or words[0].startswith("tw-"))


def check_story_file(path: Path) -> None:
    """Check a Z-machine header and checksum before the interpreter sees the file.

    Frotz ends the whole process on a malformed story file, so this must catch it first.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GameFileError(f"game file {str(path)!r} cannot be read ({exc.strerror})") from None
    fix = "regenerate it (envs.twgen.generate_textworld_games)"
    version = data[0] if data else 0
    if len(data) < 64 or not 1 <= version <= 8:
        raise GameFileError(f"game file {str(path)!r} is not a Z-machine story file: {fix}")
    scale = 2 if version <= 3 else 4 if version <= 5 else 8
    length = int.from_bytes(data[0x1A:0x1C], "big") * scale
    checksum = int.from_bytes(data[0x1C:0x1E], "big")
    if length > len(data):
        raise GameFileError(
            f"game file {str(path)!r} is truncated ({len(data)} of {length} bytes): {fix}"
        )
    if length and checksum and sum(data[0x40:length]) % 0x10000 != checksum:
        raise GameFileError(f"game file {str(path)!r} is corrupt (bad checksum): {fix}")


def check_game_path(path: Path) -> None:
    """Clear errors for a missing file, a wrong extension or a missing ``.json`` companion."""
    if not path.exists():
        raise GameFileError(f"game file {str(path)!r} does not exist")
    if not path.is_file():
        raise GameFileError(f"game file {str(path)!r} is not a file")
    ext = path.suffix.lower()
    if ext == ".ulx":
        raise GameFileError(
            f"game file {str(path)!r} is a Glulx game, which textworld>=1.7 cannot play: "
            "regenerate it as .z8 (envs.twgen.generate_textworld_games)"
        )
    if ext not in Z_EXTENSIONS:
        raise GameFileError(
            f"game file {str(path)!r} has extension {ext or '(none)'!r}: "
            "expected a TextWorld .z8 game with its .json next to it"
        )
    if not path.with_suffix(".json").is_file():
        raise GameFileError(
            f"game file {str(path)!r} has no {path.with_suffix('.json').name!r} next to it: "
            "TextWorld needs it for admissible commands and scores; regenerate the game"
        )


def game_walkthrough(path: Path) -> list[str] | None:
    """The walkthrough in the ``.json`` TextWorld keeps beside a game (None without one), read
    without playing."""
    try:
        data = json.loads(Path(path).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    walkthrough = (
        (data.get("metadata") or {}).get("walkthrough") if isinstance(data, dict) else None
    )
    return [str(a) for a in walkthrough] if walkthrough else None


def discover_textworld_games(game_dir: Path) -> dict[str, Path]:
    """Z-machine games under ``game_dir`` (recursively), keyed by path relative to it."""
    if not game_dir.is_dir():
        raise EnvError(f"game dir {str(game_dir)!r} does not exist or is not a folder")
    games = {
        p.relative_to(game_dir).as_posix(): p
        for p in game_dir.rglob("*")
        if p.suffix.lower() in Z_EXTENSIONS and p.is_file()
    }
    if not games:
        glulx = sum(1 for _ in game_dir.rglob("*.ulx"))
        hint = (
            f" (found {glulx} Glulx .ulx games, which textworld>=1.7 cannot play)" if glulx else ""
        )
        raise EnvError(
            f"no .z8 games under {str(game_dir)!r}{hint}: "
            "generate some with envs.twgen.generate_textworld_games"
        )
    return dict(sorted(games.items()))


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _make_engine() -> Any:
    """TextWorld's Inform 7 wrapper around its Jericho backend, as ``textworld.start`` builds it."""
    # heavy: textworld, only to play or make a game
    import textworld
    from textworld.envs import JerichoEnv, TWInform7

    infos = textworld.EnvInfos(
        feedback=True,
        admissible_commands=True,
        won=True,
        lost=True,
        score=True,
        max_score=True,
        objective=True,
    )
    return TWInform7(JerichoEnv(infos))


class TextWorldEnv(gym.Env[str, str]):
    """TextWorld games: one ``game_file``, or every ``.z8`` under ``game_dir``.

    ``reset(options={"game": id})`` picks a game (ids are in ``game_ids``: paths relative to
    ``game_dir``, or the file name for ``game_file``); without it the seed picks one. The reward is
    the score delta; ``terminated`` on won or lost; ``truncated`` only from ``max_steps``. ``info``
    carries ``admissible_commands``, ``won``, ``lost``, ``score``, ``max_score``, ``task`` (the
    objective), ``task_type`` ("textworld"), ``game``, ``game_file``, ``max_steps`` and ``steps``;
    never the walkthrough (ground truth: :func:`game_walkthrough` reads it from the game files).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        game_file: str | os.PathLike[str] | None = None,
        game_dir: str | os.PathLike[str] | None = None,
        max_steps: int = 50,
        render_mode: str | None = None,
    ) -> None:
        if max_steps <= 0:
            raise EnvError(f"max_steps must be > 0, got {max_steps}")
        if (game_file is None) == (game_dir is None):
            raise EnvError(
                "pass exactly one of game_file=... (one game) or game_dir=... (a folder)"
            )
        if game_file is not None:
            path = Path(game_file)
            check_game_path(path)
            self._paths = {path.name: path}
        else:
            self._paths = discover_textworld_games(Path(str(game_dir)))
        self.game_ids: list[str] = list(self._paths)
        self.max_steps = max_steps
        self.render_mode = render_mode
        self.observation_space = text_space(MAX_OBSERVATION)
        self.action_space = text_space(MAX_ACTION)
        self._engine: Any = None
        self._loaded: str | None = None
        self._game: str | None = None
        self._task = ""
        self._max_score = 0
        self._steps = 0
        self._score = 0
        self._won = False
        self._lost = False
        self._admissible: list[str] = []
        self._last_obs = ""

    # -- gymnasium API -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        game_id = pick_game(options, self.game_ids, self.np_random)
        path = self._paths[game_id]
        if self._loaded != game_id:
            self._load(game_id, path)
        state = self._engine.reset()
        self._game = game_id
        self._steps = 0
        self._score = int(state["score"] or 0)
        self._won = bool(state["won"])
        self._lost = bool(state["lost"])
        obs = printable(clean_text(strip_banner(state["feedback"] or "")))
        if self._task and _squash(self._task) not in _squash(obs):
            self._unload()
            raise GameFileError(
                f"game file {str(path)!r} does not match its .json (the objective is not in the "
                "opening text): regenerate the pair"
            )
        self._last_obs = obs
        return obs, self._info(state)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._game is None:
            raise RuntimeError("call reset() before step()")
        self._steps += 1
        command = normalize_action(action)
        if self._won or self._lost:
            # Past the end the interpreter is in its RESTART/UNDO prompt; keep the outcome.
            obs, reward, info = GAME_OVER, 0.0, self._info(None)
        elif is_meta_command(command):
            obs, reward, info = NOT_AVAILABLE, 0.0, self._info(None)
        else:
            state, _, _ = self._engine.step(command)
            score = int(state["score"] if state["score"] is not None else self._score)
            reward = float(score - self._score)
            self._score = score
            self._won = bool(state["won"])
            self._lost = bool(state["lost"])
            obs = printable(clean_text(state["feedback"] or ""))
            info = self._info(state)
        terminated = self._won or self._lost
        truncated = (not terminated) and self._steps >= self.max_steps
        self._last_obs = obs
        return obs, reward, terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last_obs
        return None

    def close(self) -> None:
        self._unload()

    # -- helpers -------------------------------------------------------------------------
    def _load(self, game_id: str, path: Path) -> None:
        check_game_path(path)
        check_story_file(path)
        if self._engine is None:
            self._engine = _make_engine()
        else:
            self._shutdown_interpreter()
        try:
            self._engine.load(str(path))
        except Exception as exc:  # TextWorld's own parse errors are deep and cryptic
            self._unload()
            raise GameFileError(
                f"game file {str(path)!r} could not be loaded ({exc.__class__.__name__}: "
                f"{str(exc)[:120]}): regenerate it"
            ) from None
        self._engine.seed(EMULATOR_SEED)  # Jericho's load() resets the seed to time-based
        game = self._engine._game
        self._task = printable(str(game.objective or "").strip())
        self._max_score = int(game.max_score or 0)
        self._loaded = game_id

    def _shutdown_interpreter(self) -> None:
        # Free the running story before loading the next (Jericho's load() does not), and drop
        # the story files it caches, which would otherwise grow by one file per game.
        frotz = getattr(self._engine.unwrapped, "_jericho", None)
        if frotz is not None:
            frotz.close()
            cache = getattr(frotz, "_cache", None)
            if isinstance(cache, dict):
                cache.clear()

    def _unload(self) -> None:
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception:  # closing a half-loaded engine must not mask the error
                pass
        self._engine = None
        self._loaded = None
        self._game = None

    def _info(self, state: Any) -> dict[str, Any]:
        assert self._game is not None
        if state is not None:
            self._admissible = [str(c) for c in state["admissible_commands"] or []]
        info: dict[str, Any] = {
            "admissible_commands": list(self._admissible),
            "won": self._won,
            "lost": self._lost,
            "score": self._score,
            "max_score": self._max_score,
            "task": self._task,
            "task_type": TASK_TYPE,
            "game": self._game,
            "game_file": str(self._paths[self._game]),
            "max_steps": self.max_steps,
            "steps": self._steps,
        }
        return info
