"""The games of a run: explicit ids, else a split's first N; ALFWorld's (given or generated on
first use) or TextWorld's (given or generated on first use)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.discovery import SPLITS, TASK_TYPES, discover_games
from envs.ground_truth import GameFileTruth
from envs.textworld_env import discover_textworld_games
from envs.translations import cache_dir
from envs.twgen import generate_textworld_games
from experiments.config import MAX_RESET_CACHE, RunConfig, data_root
from experiments.errors import ConfigError
from experiments.trials import Task

log = logging.getLogger("reflexsim.games")

DEFAULT_GAMES = Path.home() / ".cache" / "reflexsim" / "games"


@dataclass(frozen=True)
class GameSet:
    env_kind: str  # "alfworld" | "textworld"
    env_kwargs: dict[str, Any]
    tasks: list[Task]
    files: dict[str, Path]  # game id -> file, for hashing
    source: str = ""  # where the games come from, in words

    @functools.cached_property
    def ground_truth(self) -> GameFileTruth:
        """The games' ground truth, read from their files: for scripted policies and the
        ``oracle`` value only (see :mod:`agents.llm.ground_truth`)."""
        return GameFileTruth(self.env_kind, self.files)


def select_games(cfg: RunConfig) -> GameSet:
    """The games of the run: explicit ids, else the split's first N (sorted by id)."""
    if cfg.gameset.env == "textworld":
        return _textworld_games(cfg)

    data = data_root(cfg)
    if data is None:
        data = str(_generated_default(cfg))
    records = discover_games(data, cfg.gameset.split, list(cfg.gameset.task_types) or None)
    if cfg.gameset.game_ids:
        by_id = {r.game_id: r for r in records}
        missing = [g for g in cfg.gameset.game_ids if g not in by_id]
        if missing:
            raise ConfigError(
                f"unknown game id {missing[0]!r} in split {cfg.gameset.split!r} of {data!r}"
            )
        records = [by_id[g] for g in cfg.gameset.game_ids]
    elif cfg.gameset.games is not None:
        records = records[: cfg.gameset.games]

    tasks = [Task(r.game_id, TASK_TYPES[r.task_type]) for r in records]
    kwargs = {
        "data_dir": data,
        "split": cfg.gameset.split,
        "max_steps": cfg.protocol.max_steps,
        "games": [t.game for t in tasks],
        "reset_cache": reset_cache(cfg, len(tasks)),
        "translation_cache": cache_dir(cfg.execution.translation_cache),
    }
    source = f"{cfg.gameset.split} of {data}"
    return GameSet("alfworld", kwargs, tasks, {r.game_id: r.path for r in records}, source)


def reset_cache(cfg: RunConfig, games: int) -> int:
    """The games each env worker keeps (``--reset-cache``): by default every game of the run
    (each trial resets them all again; a game goes back to the worker that loaded it), at most
    ``MAX_RESET_CACHE``."""
    given = cfg.execution.reset_cache
    return min(max(games, 1), MAX_RESET_CACHE) if given is None else given


def generated_games_dir(cfg: RunConfig) -> Path:
    """Where the default generated ALFWorld games for this config are kept (per generator
    version: a newer generator never reuses an older one's games)."""
    from envs.alfgen import GENERATOR_VERSION  # lazily: ~60 ms, only for generated games

    return (
        DEFAULT_GAMES
        / f"v{GENERATOR_VERSION}-seed{cfg.protocol.seed}-n{cfg.gameset.generate_per_type}"
    )


def _generated_default(cfg: RunConfig) -> Path:
    """Games made on first use when no ALFWorld data is given (contamination-free)."""
    from envs.alfgen import generate  # lazily: ~60 ms, only for generated games

    root = generated_games_dir(cfg)
    marker = root / SPLITS[cfg.gameset.split] / ".complete"
    if not marker.is_file():
        log.info(
            "generating %d game(s) per task type into %s ...", cfg.gameset.generate_per_type, root
        )
        generate(
            root,
            per_type=cfg.gameset.generate_per_type,
            seed=cfg.protocol.seed,
            split=cfg.gameset.split,
        )
        marker.write_text("ok\n")
    return root


def textworld_cache_dir(cfg: RunConfig) -> Path:
    """Where generated TextWorld games for this config are kept (made on first use)."""
    return DEFAULT_GAMES / f"textworld-seed{cfg.protocol.seed}-n{max(cfg.gameset.games or 3, 1)}"


def _textworld_games(cfg: RunConfig) -> GameSet:
    game_dir = cfg.gameset.data
    if game_dir is None:
        root = textworld_cache_dir(cfg)
        n = int(root.name.rsplit("-n", 1)[1])
        if not (root / ".complete").is_file():
            generate_textworld_games(root, n=n, seed=cfg.protocol.seed)
            (root / ".complete").write_text("ok\n")
        game_dir = str(root)
    found = discover_textworld_games(Path(game_dir))
    ids = list(cfg.gameset.game_ids) or sorted(found)
    if cfg.gameset.games is not None and not cfg.gameset.game_ids:
        ids = ids[: cfg.gameset.games]
    tasks = [Task(g, "textworld") for g in ids]
    kwargs = {"game_dir": game_dir, "max_steps": cfg.protocol.max_steps}
    return GameSet("textworld", kwargs, tasks, {g: found[g] for g in ids}, f"TextWorld {game_dir}")
