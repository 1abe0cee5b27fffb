"""Set up and run one experiment: games, model, env pool, run store, manifest, budgets, resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from agents.evaluators import make_evaluator
from agents.llm import make_backend
from agents.llm.base import Backend, GenerationConfig
from agents.parsing import GroundingRules
from agents.prompting import template_hashes
from experiments.config import RunConfig, parse_deadline
from experiments.errors import ConfigError, RunStoreError
from experiments.rollout import Rollout, RolloutSettings
from experiments.store import RunStore
from experiments.trials import Task, TrialSettings, run_trials

log = logging.getLogger("reflexsim.runner")

ACTION_SYNTAX = "alfworld-0.4 (move X to Y; You arrive at <receptacle>)"
# Keys that may differ between a run and its resume without changing its results. ``trials``
# too: trial k depends only on trials 0..k-1, so a finished run resumed with more trials plays
# the extra ones (the manifest records the new count).
RESUMABLE_KEYS = {
    "trials",
    "run_dir",
    "workers",
    "concurrency",
    "deadline",
    "budget_tokens",
    "budget_usd",
    "step_timeout_s",
}
DEFAULT_GAMES = Path.home() / ".cache" / "reflexsim" / "games"


@dataclass(frozen=True)
class GameSet:
    env_kind: str  # "alfworld" | "textworld"
    env_kwargs: dict[str, Any]
    tasks: list[Task]
    files: dict[str, Path]  # game id -> file, for hashing


def select_games(cfg: RunConfig) -> GameSet:
    """The games of the run: explicit ids, else the split's first N (sorted by id)."""
    if cfg.env == "textworld":
        return _textworld_games(cfg)
    from envs.discovery import discover_games

    data = cfg.data or os.environ.get("ALFWORLD_DATA")
    if data is None:
        data = str(_generated_default(cfg))
    records = discover_games(data, cfg.split, list(cfg.task_types) or None)
    if cfg.game_ids:
        by_id = {r.game_id: r for r in records}
        missing = [g for g in cfg.game_ids if g not in by_id]
        if missing:
            raise ConfigError(f"unknown game id {missing[0]!r} in split {cfg.split!r} of {data!r}")
        records = [by_id[g] for g in cfg.game_ids]
    elif cfg.games is not None:
        records = records[: cfg.games]
    from envs.discovery import TASK_TYPES

    tasks = [Task(r.game_id, TASK_TYPES[r.task_type]) for r in records]
    kwargs = {
        "data_dir": data,
        "split": cfg.split,
        "max_steps": cfg.max_steps,
        "games": [t.game for t in tasks],
    }
    return GameSet("alfworld", kwargs, tasks, {r.game_id: r.path for r in records})


def generated_games_dir(cfg: RunConfig) -> Path:
    """Where the default generated ALFWorld games for this config are kept."""
    return DEFAULT_GAMES / f"seed{cfg.seed}-n{cfg.generate_per_type}"


def _generated_default(cfg: RunConfig) -> Path:
    """Games made on first use when no ALFWorld data is given (contamination-free)."""
    from envs.alfgen import generate
    from envs.discovery import SPLITS

    root = generated_games_dir(cfg)
    marker = root / SPLITS[cfg.split] / ".complete"
    if not marker.is_file():
        print(
            f"generating {cfg.generate_per_type} game(s) per task type into {root} ...",
            file=sys.stderr,
        )
        generate(root, per_type=cfg.generate_per_type, seed=cfg.seed, split=cfg.split)
        marker.write_text("ok\n")
    return root


def textworld_cache_dir(cfg: RunConfig) -> Path:
    """Where generated TextWorld games for this config are kept (made on first use)."""
    return DEFAULT_GAMES / f"textworld-seed{cfg.seed}-n{max(cfg.games or 3, 1)}"


def _textworld_games(cfg: RunConfig) -> GameSet:
    from envs.textworld_env import discover_textworld_games

    game_dir = cfg.data
    if game_dir is None:
        from envs.twgen import generate_textworld_games

        root = textworld_cache_dir(cfg)
        n = int(root.name.rsplit("-n", 1)[1])
        if not (root / ".complete").is_file():
            generate_textworld_games(root, n=n, seed=cfg.seed)
            (root / ".complete").write_text("ok\n")
        game_dir = str(root)
    found = discover_textworld_games(Path(game_dir))
    ids = list(cfg.game_ids) or sorted(found)
    if cfg.games is not None and not cfg.game_ids:
        ids = ids[: cfg.games]
    tasks = [Task(g, "textworld") for g in ids]
    kwargs = {"game_dir": game_dir, "max_steps": cfg.max_steps}
    return GameSet("textworld", kwargs, tasks, {g: found[g] for g in ids})


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("reflexsim", "alfworld", "textworld", "gymnasium", "vllm", "openai", "anthropic",
                 "transformers", "torch", "llama-cpp-python"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def build_manifest(
    cfg: RunConfig, games: GameSet, actor: Backend, reflector: Backend
) -> dict[str, Any]:
    def describe(b: Backend) -> Any:
        fn = getattr(b, "describe", None)
        return fn() if callable(fn) else {"name": b.name}

    return {
        "config": cfg.to_dict(),
        "versions": _versions(),
        "git_commit": _git_commit(),
        "action_syntax": ACTION_SYNTAX,
        "games": {g: _file_hash(p) for g, p in sorted(games.files.items())},
        "prompt_templates": template_hashes(),
        "prompts_file": _file_hash(Path(cfg.prompts)) if cfg.prompts else None,
        "actor": describe(actor),
        "reflector": describe(reflector),
        "generation": generation_config(cfg).__dict__,
        "seed": cfg.seed,
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "started_at": time.time(),
    }


def manifest_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = []
    old_cfg, new_cfg = old.get("config", {}), new.get("config", {})
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if key not in RESUMABLE_KEYS and old_cfg.get(key) != new_cfg.get(key):
            diffs.append(f"{key}: {old_cfg.get(key)!r} -> {new_cfg.get(key)!r}")
    for key in ("games", "prompt_templates", "prompts_file", "action_syntax"):
        if old.get(key) != new.get(key):
            diffs.append(f"{key} changed")
    return diffs


def generation_config(cfg: RunConfig) -> GenerationConfig:
    return GenerationConfig(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        stop=("\n",),
        seed=cfg.seed,
    )


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.model)[:40]
    return Path("runs") / f"{stamp}-{model}-{cfg.agent.replace('+', '_')}"


def _backend_options(cfg: RunConfig) -> dict[str, Any]:
    options = dict(cfg.backend_options)
    if cfg.base_url:
        options["base_url"] = cfg.base_url
    if cfg.chat_format:
        options["chat_format"] = cfg.chat_format
    return options


def make_backends(cfg: RunConfig) -> tuple[Backend, Backend]:
    actor = make_backend(cfg.model, **_backend_options(cfg))
    if cfg.reflector_model == cfg.model:
        return actor, actor
    return actor, make_backend(cfg.reflector_model, **_backend_options(cfg))


class _Budget:
    """Stops the run cleanly on a token, cost or wall-clock budget."""

    def __init__(self, cfg: RunConfig, store: RunStore, rollout: Rollout) -> None:
        self.cfg = cfg
        self.store = store
        self.rollout = rollout
        self.start_tokens = (
            sum(store.token_totals().values()) if cfg.budget_tokens or cfg.budget_usd else 0
        )
        self.deadline = parse_deadline(cfg.deadline, time.time())

    def __call__(self) -> str | None:
        if self.deadline is not None and time.time() >= self.deadline:
            return f"deadline {self.cfg.deadline} reached"
        if self.cfg.budget_tokens is not None:
            used = self.store_tokens()
            if used >= self.cfg.budget_tokens:
                return f"token budget {self.cfg.budget_tokens} reached ({used})"
        if self.cfg.budget_usd is not None:
            cost = run_cost(self.store, self.cfg)
            if cost >= self.cfg.budget_usd:
                return f"cost budget ${self.cfg.budget_usd} reached (${cost:.4f})"
        return None

    def store_tokens(self) -> int:
        totals = self.store.token_totals()
        return totals["prompt"] + totals["completion"]


def run_cost(store: RunStore, cfg: RunConfig) -> float:
    try:
        from agents.llm.pricing import cost_usd
    except ImportError:
        return 0.0
    t = store.token_totals()
    return float(cost_usd(cfg.model, t["prompt"], t["completion"], t["cached_prompt"]))


class _Progress:
    """Episodes done per trial, success so far, tokens; silent when stderr is not a terminal."""

    def __init__(self, store: RunStore, total_tasks: int) -> None:
        self.store = store
        self.total = total_tasks
        self.bar: Any = None
        self.enabled = sys.stderr.isatty()
        self.trial = 0

    def on_trial(self, trial: int, n: int) -> None:
        self.close()
        self.trial = trial
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=n, desc=f"trial {trial}", unit="ep", file=sys.stderr)
        else:
            print(f"trial {trial}: {n} episode(s) to play", file=sys.stderr)

    def on_episode(self, episode: str, won: bool) -> None:
        if self.bar is not None:
            solved = len({e.game for e in self.store.episodes() if e.won})
            t = self.store.token_totals()
            self.bar.set_postfix(
                solved=f"{solved}/{self.total}", tokens=t["prompt"] + t["completion"]
            )
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


LOGGERS = ("reflexsim", "agents", "envs")


class _RunLog:
    """INFO and above from the project's loggers into ``<run dir>/run.log`` while a run lasts
    (batch sizes, retries, crashes: what the morning reader needs); the console is left alone."""

    def __init__(self, run_dir: Path) -> None:
        self.handler = logging.FileHandler(run_dir / "run.log")
        self.handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        self.handler.setLevel(logging.INFO)
        self.saved: list[tuple[logging.Logger, int]] = []

    def __enter__(self) -> None:
        for name in LOGGERS:
            logger = logging.getLogger(name)
            self.saved.append((logger, logger.level))
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        for logger, level in self.saved:
            logger.removeHandler(self.handler)
            logger.setLevel(level)
        self.handler.close()


def run(cfg: RunConfig, resume: str | None = None, force: bool = False) -> Path:
    """Run (or resume) an experiment; returns the run directory."""
    from envs.pool import EnvPool, EnvSpec

    games = select_games(cfg)
    run_dir = Path(resume) if resume else Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    if resume:
        store = RunStore(run_dir)
        played = len(store.trials())
        if cfg.trials < played:
            store.close()
            raise RunStoreError(
                f"the run in {str(run_dir)!r} has started {played} trials: "
                f"resume with --trials {played} or more"
            )
    else:
        if (run_dir / "run.sqlite").exists():
            raise RunStoreError(
                f"{str(run_dir)!r} already holds a run: use --resume {run_dir} or another --run-dir"
            )
        store = RunStore(run_dir, create=True)
    actor, reflector = make_backends(cfg)
    manifest = build_manifest(cfg, games, actor, reflector)
    old = store.get_meta("manifest")
    if old is not None:
        diffs = manifest_differences(old, manifest)
        if diffs and not force:
            raise RunStoreError(
                f"the run in {str(run_dir)!r} was made with a different setup ({'; '.join(diffs[:3])}): "
                "resume with the same config, or pass --force"
            )
        store.log_event("resume", json.dumps({"differences": diffs, "forced": bool(diffs)}))
        manifest = {**old, "resumed_at": time.time()}
        manifest["config"] = {**old.get("config", {}), "trials": cfg.trials}
    store.set_meta("manifest", manifest)
    print(
        json.dumps({"run_dir": str(run_dir), **cfg.to_dict()}, indent=1, default=str),
        file=sys.stderr,
    )

    settings = RolloutSettings(
        arm=cfg.agent,
        generation=generation_config(cfg),
        evaluator=make_evaluator(cfg.evaluator, cfg.count_thoughts),
        # put X in/on Y -> move X to Y is ALFWorld 0.4's syntax; TextWorld keeps `put`
        grounding=GroundingRules(put_to_move=cfg.env == "alfworld")
        if cfg.grounding
        else GroundingRules.none(),
        max_steps=cfg.max_steps,
        count_thoughts=cfg.count_thoughts,
    )
    trial_settings = TrialSettings(
        arm=cfg.agent,
        trials=cfg.trials,
        memory_size=cfg.memory_size,
        evaluator=cfg.evaluator,
        reflect_model=cfg.reflector_model,
        reflect_max_tokens=cfg.reflect_max_tokens,
        prompts_file=cfg.prompts,
        seed=cfg.seed,
    )
    progress = _Progress(store, len(games.tasks))
    pool = EnvPool(
        EnvSpec(games.env_kind, games.env_kwargs),
        workers=cfg.workers,
        slots=min(cfg.concurrency, max(len(games.tasks), 1)),
        timeout_s=cfg.step_timeout_s,
    )
    started = time.time()
    with _RunLog(run_dir):
        try:
            rollout = Rollout(actor, pool, store, settings, on_episode_done=progress.on_episode)
            rollout.should_stop = _Budget(cfg, store, rollout)
            stopped = run_trials(
                store, games.tasks, rollout, reflector, trial_settings, progress.on_trial
            )
        finally:
            progress.close()
            pool.close()
            actor.close()
            if reflector is not actor:
                reflector.close()
            wall = store.get_meta("wall_s", 0.0) + (time.time() - started)
            store.set_meta("wall_s", wall)
            store.close()
    status = {"stopped": stopped} if stopped else {"complete": True}
    _write_status(run_dir, status)
    return run_dir


def _write_status(run_dir: Path, status: dict[str, Any]) -> None:
    store = RunStore(run_dir)
    try:
        store.set_meta("status", status)
        if status.get("stopped"):
            store.log_event("budget", str(status["stopped"]))
    finally:
        store.close()


def plan(cfg: RunConfig) -> dict[str, Any]:
    """What a run would do, without running it (``--dry-run``)."""
    games = select_games(cfg)
    by_type: dict[str, int] = {}
    for t in games.tasks:
        by_type[t.task_type] = by_type.get(t.task_type, 0) + 1
    return estimated_plan(
        cfg,
        len(games.tasks),
        env=games.env_kind,
        games_by_type=by_type,
        first_games=[t.game for t in games.tasks[:5]],
    )


def estimated_plan(cfg: RunConfig, n: int, **games: Any) -> dict[str, Any]:
    """The plan of a run over ``n`` games (``games``: what is known about them)."""
    reflections = 0 if cfg.agent == "react" else n * (cfg.trials - 1)
    return {
        "model": cfg.model,
        "reflect_model": cfg.reflector_model,
        "arm": cfg.agent,
        "evaluator": cfg.evaluator,
        "env": cfg.env,
        "games": n,
        **games,
        "trials": cfg.trials,
        "max_steps": cfg.max_steps,
        "memory_size": cfg.memory_size,
        "estimated_requests": {
            "actor_steps_at_most": n * cfg.trials * cfg.max_steps,
            "reflections_at_most": reflections,
            "judge_calls_at_most": n * cfg.trials if cfg.evaluator == "llm" else 0,
        },
        "config": cfg.to_dict(),
    }
