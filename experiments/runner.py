"""One run: ``prepare(config) -> Plan`` (games, run dir, backends and manifest, resolved once)
and ``execute(plan)`` (env pool, engine, trial loop, run store, budgets, resume)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from agents import arms
from agents.arm import ArmContext, SearchLog
from agents.episode import Agent
from agents.evaluators import make_evaluator
from agents.experience import Experience
from agents.llm import make_backend
from agents.llm.base import Backend, GenerationConfig
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.parsing import GroundingRules
from agents.prompting import PromptFileError, load_original_prompts, sha256, template_hashes
from agents.react import ActorSettings
from agents.reflexion import ReflexionSettings
from agents.reflexion_code import CODE_PROTOCOL, CodePrompts, layout_text, read_wording
from envs.aio import AsyncEnvPool
from envs.ground_truth import GameFileTruth
from experiments.config import (
    RESUMABLE_KEYS,
    RunConfig,
    data_root,
    parse_deadline,
    public_values,
)
from experiments.engine import Engine, ModelClient, Usage
from experiments.errors import ConfigError, RunStoreError
from experiments.experience import for_run as experience_for
from experiments.lock import DirLock
from experiments.store import DB_NAME, LOCK_NAME, RunStore
from experiments.terminal import EscapingFormatter, QuietFileHandler
from experiments.trials import Escalation, Safeguards, Task, TrialLoop, TrialPlan

log = logging.getLogger("reflexsim.runner")

ACTION_SYNTAX = "alfworld-0.4 (move X to Y; You arrive at <receptacle>)"
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
    from envs.discovery import discover_games

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
    from envs.discovery import TASK_TYPES

    tasks = [Task(r.game_id, TASK_TYPES[r.task_type]) for r in records]
    kwargs = {
        "data_dir": data,
        "split": cfg.gameset.split,
        "max_steps": cfg.protocol.max_steps,
        "games": [t.game for t in tasks],
    }
    source = f"{cfg.gameset.split} of {data}"
    return GameSet("alfworld", kwargs, tasks, {r.game_id: r.path for r in records}, source)


def generated_games_dir(cfg: RunConfig) -> Path:
    """Where the default generated ALFWorld games for this config are kept (per generator
    version: a newer generator never reuses an older one's games)."""
    from envs.alfgen import GENERATOR_VERSION

    return (
        DEFAULT_GAMES
        / f"v{GENERATOR_VERSION}-seed{cfg.protocol.seed}-n{cfg.gameset.generate_per_type}"
    )


def _generated_default(cfg: RunConfig) -> Path:
    """Games made on first use when no ALFWorld data is given (contamination-free)."""
    from envs.alfgen import generate
    from envs.discovery import SPLITS

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
    from envs.textworld_env import discover_textworld_games

    game_dir = cfg.gameset.data
    if game_dir is None:
        from envs.twgen import generate_textworld_games

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
    cfg: RunConfig, games: GameSet, actor: Backend, reflector: Backend, data: str | None
) -> dict[str, Any]:
    def describe(b: Backend) -> Any:
        fn = getattr(b, "describe", None)
        return fn() if callable(fn) else {"name": b.name}

    return {
        "config": cfg.to_dict(public=True),
        "data_root": data,
        "versions": _versions(),
        "git_commit": _git_commit(),
        "action_syntax": ACTION_SYNTAX,
        "games": {g: _file_hash(p) for g, p in sorted(games.files.items())},
        "prompt_templates": template_hashes(),
        "prompts_file": _file_hash(Path(cfg.protocol.prompts)) if cfg.protocol.prompts else None,
        "protocol": cfg.protocol.protocol,
        "prompt_files": prompt_file_hashes(cfg),
        "actor": describe(actor),
        "reflector": describe(reflector),
        "generation": generation_config(cfg).__dict__,
        "seed": cfg.protocol.seed,
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "started_at": time.time(),
    }


def manifest_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between a run's manifest and a resume's, beyond the resumable keys."""
    diffs = []
    # public copies: a manifest written before secrets were left out compares (and prints) alike
    old_cfg, new_cfg = public_values(old.get("config", {})), public_values(new.get("config", {}))
    defaults = RunConfig().to_dict()
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if key in RESUMABLE_KEYS:
            continue
        # a key a newer version added reads as its default in an older manifest
        was, now = old_cfg.get(key, defaults.get(key)), new_cfg.get(key, defaults.get(key))
        if was != now:
            diffs.append(f"{key}: {was!r} -> {now!r}")
    for key in ("games", "prompt_templates", "prompts_file", "action_syntax"):
        if old.get(key) != new.get(key):
            diffs.append(f"{key} changed")
    if old.get("prompt_files", {}) != new.get("prompt_files", {}):  # older manifests lack it
        diffs.append("prompt_files changed")
    return diffs


def generation_config(cfg: RunConfig) -> GenerationConfig:
    return GenerationConfig(
        temperature=cfg.models.temperature,
        top_p=cfg.models.top_p,
        max_tokens=cfg.models.max_tokens,
        stop=("\n",),
        seed=cfg.protocol.seed,
    )


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.models.model)[:40]
    return Path("runs") / f"{stamp}-{model}-{cfg.protocol.agent.replace('+', '_')}"


def _backend_options(cfg: RunConfig) -> dict[str, Any]:
    options = dict(cfg.models.backend_options)
    if cfg.models.base_url:
        options["base_url"] = cfg.models.base_url
    if cfg.models.chat_format:
        options["chat_format"] = cfg.models.chat_format
    return options


def make_backends(cfg: RunConfig, truth: GroundTruth = NO_GROUND_TRUTH) -> tuple[Backend, Backend]:
    actor = make_backend(cfg.models.model, ground_truth=truth, **_backend_options(cfg))
    if cfg.models.reflector == cfg.models.model:
        return actor, actor
    try:
        return actor, make_backend(
            cfg.models.reflector, ground_truth=truth, **_backend_options(cfg)
        )
    except BaseException:
        actor.close()
        raise


def run_cost(usage_prompt: int, usage_completion: int, cached: int, model: str) -> float:
    try:
        from agents.llm.pricing import cost_usd
    except ImportError:
        return 0.0
    return float(cost_usd(model, usage_prompt, usage_completion, cached))


class Budget:
    """Stops the run cleanly on a token, cost or wall-clock budget (checked before each call)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.budget
        self.model = cfg.models.model
        self.deadline = parse_deadline(cfg.budget.deadline, time.time())

    def __call__(self, usage: Usage) -> str | None:
        if self.deadline is not None and time.time() >= self.deadline:
            return f"deadline {self.cfg.deadline} reached"
        if self.cfg.budget_tokens is not None and usage.total >= self.cfg.budget_tokens:
            return f"token budget {self.cfg.budget_tokens} reached ({usage.total})"
        if self.cfg.budget_usd is not None:
            cost = run_cost(usage.prompt, usage.completion, usage.cached_prompt, self.model)
            if cost >= self.cfg.budget_usd:
                return f"cost budget ${self.cfg.budget_usd} reached (${cost:.4f})"
        return None


class Progress(Protocol):
    """What a run reports as it goes (the CLI draws it; library code only calls it)."""

    def begin(self, summary: dict[str, Any]) -> None: ...

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None: ...

    def episode_done(self, won: bool, tokens: int) -> None: ...

    def task_done(self, won: bool, episodes_saved: int) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def begin(self, summary: dict[str, Any]) -> None:
        pass

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        pass

    def episode_done(self, won: bool, tokens: int) -> None:
        pass

    def task_done(self, won: bool, episodes_saved: int) -> None:
        pass

    def close(self) -> None:
        pass


LOGGERS = ("reflexsim", "agents", "envs")


class _RunLog:
    """INFO and above from the project's loggers into ``<run dir>/run.log`` while a run lasts
    (batch sizes, retries, crashes: what the morning reader needs); the console is left alone."""

    def __init__(self, run_dir: Path) -> None:
        self.handler = QuietFileHandler(run_dir / "run.log")
        self.handler.setFormatter(
            EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
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


@dataclass
class Plan:
    """A run resolved once: config, games, run dir, manifest and the model backends."""

    cfg: RunConfig
    run_dir: Path
    games: GameSet
    manifest: dict[str, Any]
    actor: Backend
    reflector: Backend
    resumed: bool
    lock: DirLock | None = None  # the run directory's, held until close (None: the caller's)
    extras: dict[str, Backend] = field(default_factory=dict)  # planner, escalate: own models
    experience: Experience | None = None  # other games' experience the run shows

    def close(self) -> None:
        try:
            _close_all([self.actor, self.reflector, *self.extras.values()])
        finally:
            if self.lock is not None:
                self.lock.release()


def _close_all(backends: list[Backend]) -> None:
    """Close each backend once (the actor often doubles as the reflector)."""
    for backend in {id(b): b for b in backends}.values():
        backend.close()


def check_prompts_file(cfg: RunConfig, games: GameSet) -> None:
    """The ``prompts`` file read whole, with a pair of examples for every task type the run
    plays: a bad file is one line now, not a crash once the run is under way."""
    if not cfg.protocol.prompts:
        return
    try:
        load_original_prompts(cfg.protocol.prompts, sorted({t.task_type for t in games.tasks}))
    except PromptFileError as exc:
        raise ConfigError(f"--prompts: {exc}") from None


def run_lock(run_dir: Path) -> DirLock:
    """The lock of one writer per run directory, held for the run's whole life."""
    return DirLock(run_dir, LOCK_NAME)


def refuse_live_run(run_dir: Path) -> None:
    """A one-line RunStoreError naming the process that runs in ``run_dir`` now, if one does
    (writes nothing into the directory)."""
    run_lock(run_dir).refuse_if_held("a run")


def prepare(
    cfg: RunConfig, resume: str | None = None, force: bool = False, lock: DirLock | None = None
) -> Plan:
    """Resolve a run: its games, run directory, backends and manifest (checked against the
    recorded one when resuming). Nothing is played yet; :func:`execute` plays it.

    Every check of the config happens here, before the run directory is written: a refused run
    leaves nothing behind that blocks the corrected command. The run directory's lock (one
    writer per directory) is taken before anything is written into it and held by the plan
    until :func:`execute` ends; ``lock``: one the caller already holds (and releases)."""
    if cfg.cluster.address:
        from experiments.ray_session import import_ray

        import_ray()  # --ray without the extra is a one-line error, here as anywhere
    games = select_games(cfg)
    check_prompts_file(cfg, games)  # the prompt files: one-line errors before anything
    _instruction(cfg)
    code_prompts(cfg)
    hashes = (
        {g: _file_hash(p) for g, p in games.files.items()} if cfg.experience.experience_from else {}
    )
    shown = experience_for(cfg, cfg.gameset.split, hashes)  # refused here: nothing written yet
    if resume:
        run_dir = Path(resume)
    elif cfg.execution.run_dir:
        run_dir = Path(cfg.execution.run_dir)
    else:
        run_dir = default_run_dir(cfg)
    cfg = cfg.replace(run_dir=str(run_dir))
    own = run_lock(run_dir) if lock is None else None
    held = lock if lock is not None else own
    assert held is not None
    try:
        return _prepare(cfg, games, run_dir, resume, force, held, own, shown)
    except BaseException:
        if own is not None:
            own.release()
        raise


def _prepare(
    cfg: RunConfig,
    games: GameSet,
    run_dir: Path,
    resume: str | None,
    force: bool,
    lock: DirLock,
    own: DirLock | None,
    shown: Experience | None = None,
) -> Plan:
    old: dict[str, Any] | None = None
    if resume:
        lock.acquire(what="a run")  # a live run is refused before its store is opened
        store = RunStore(run_dir)
        try:
            played = len(store.trials())
            old = store.get_meta("manifest")
        finally:
            store.close()
        if cfg.protocol.trials < played:
            raise RunStoreError(
                f"the run in {str(run_dir)!r} has started {played} trials: "
                f"resume with --trials {played} or more"
            )
    else:
        if not lock.held:
            refuse_live_run(run_dir)
        refuse_existing(run_dir)
    actor, reflector = make_backends(cfg, games.ground_truth)
    try:
        extras = _extra_backends(cfg, games.ground_truth)
    except BaseException:
        _close_all([actor, reflector])
        raise
    try:
        if cfg.models.action_decoding == "grounded":
            from agents.llm.common import check_grounding

            check_grounding(actor)  # a backend that cannot constrain: one line naming nearest
        manifest = build_manifest(cfg, games, actor, reflector, data_root(cfg))
        if shown is not None:  # the experience the run shows: its run and digest
            manifest["experience"] = shown.provenance.to_json()
        if old is not None:
            diffs = manifest_differences(old, manifest)
            if diffs and not force:
                raise RunStoreError(
                    f"the run in {str(run_dir)!r} was made with a different setup "
                    f"({'; '.join(diffs[:3])}): resume with the same config, or pass --force"
                )
            manifest = {**old, "resumed_at": time.time(), "resume_differences": diffs}
            manifest["config"] = {
                **old.get("config", {}),
                **{k: v for k, v in cfg.to_dict(public=True).items() if k in RESUMABLE_KEYS},
            }
        elif not lock.held:
            lock.acquire(what="a run")  # the last check: nothing was written before it
            refuse_existing(run_dir)  # another run may have begun here meanwhile
    except BaseException:
        _close_all([actor, reflector, *extras.values()])
        raise
    return Plan(
        cfg, run_dir, games, manifest, actor, reflector, old is not None, own, extras, shown
    )


def refuse_existing(run_dir: Path) -> None:
    """A one-line RunStoreError when ``run_dir`` already holds a run (a fresh run's check)."""
    if (run_dir / DB_NAME).exists():
        raise RunStoreError(
            f"{str(run_dir)!r} already holds a run: use --resume {run_dir} or another --run-dir"
        )


def execute(plan: Plan, progress: Progress | None = None) -> Path:
    """Play a prepared run to its end (or its budget); returns the run directory. Closes the
    plan's backends."""
    try:
        return asyncio.run(_execute(plan, progress or NoProgress()))
    finally:
        plan.close()


async def _execute(plan: Plan, progress: Progress) -> Path:
    from envs.pool import EnvPool, EnvSpec

    cfg, run_dir = plan.cfg, plan.run_dir
    # a resumed store was quick-checked by prepare, under the lock this process has held since
    store = RunStore(run_dir, create=not plan.resumed, check=False)
    if plan.resumed:
        store.log_event(
            "resume",
            json.dumps(
                {
                    "differences": plan.manifest.get("resume_differences", []),
                    "forced": bool(plan.manifest.get("resume_differences")),
                }
            ),
        )
    store.set_meta("manifest", plan.manifest)
    (run_dir / "config.yaml").write_text(_yaml(cfg.to_tree(public=True)))
    progress.begin(
        {
            "run_dir": str(run_dir),
            "resumed": plan.resumed,
            "model": cfg.models.model,
            "arm": cfg.protocol.agent,
            "games": len(plan.games.tasks),
            "game_source": plan.games.source,
            "trials": cfg.protocol.trials,
            "concurrency": cfg.execution.concurrency,
            "workers": cfg.execution.workers,
            "config_file": str(run_dir / "config.yaml"),
            "config": cfg.to_tree(public=True),
        }
    )
    agent = build_agent(cfg, store, plan.games.ground_truth)
    trial_plan = replace(trial_plan_of(cfg), experience=plan.experience)
    tasks = plan.games.tasks
    spec = EnvSpec(plan.games.env_kind, plan.games.env_kwargs)
    # a spare slot per worker: an episode resets its game there while it waits for its turn
    slots = min(cfg.execution.concurrency + cfg.execution.workers, max(len(tasks), 1))
    pool: Any
    if cfg.cluster.env_workers_on_ray:  # the same API; the actors run across the cluster
        from experiments.ray_session import ray_env_pool

        pool = ray_env_pool(cfg, spec, slots)
    else:
        pool = EnvPool(
            spec, workers=cfg.execution.workers, slots=slots, timeout_s=cfg.execution.step_timeout_s
        )
    envs = AsyncEnvPool(pool)
    actor = ModelClient(plan.actor, max_in_flight=cfg.execution.concurrency)
    reflector = (
        actor
        if plan.reflector is plan.actor
        else ModelClient(plan.reflector, max_in_flight=cfg.execution.concurrency)
    )
    extra = {
        role: ModelClient(backend, max_in_flight=cfg.execution.concurrency)
        for role, backend in plan.extras.items()
    }
    engine = Engine(
        store,
        actor,
        envs,
        arm=cfg.protocol.agent,
        reflector=reflector,
        planner=extra.get("planner"),
        should_stop=Budget(cfg),
        concurrency=cfg.execution.concurrency,
        on_episode_done=lambda spec, end: progress.episode_done(
            bool(end and end.won), engine.usage.total
        ),
    )
    solved_before = {e.game for e in store.episodes() if e.won}
    remaining = sum(
        cfg.protocol.trials - len([e for e in store.episodes() if e.game == t.game])
        for t in tasks
        if t.game not in solved_before
    )
    progress.start(len(tasks), remaining, len(solved_before))

    def task_done(task: Task, won: bool, trial: int) -> None:
        if task.game not in solved_before:
            progress.task_done(won, cfg.protocol.trials - 1 - trial)

    started = time.time()
    stopped: str | None = None
    ended: dict[str, Any] = {"how": "crashed"}
    if not plan.resumed:  # a resume's own event (above) marks where its process began
        store.log_event("start", json.dumps({"pid": os.getpid()}))
    with _RunLog(run_dir):
        try:
            escalate = extra.get("escalate")
            if cfg.safeguards.escalate_model == cfg.models.model:
                escalate = actor  # the same model again: its own client
            loop = TrialLoop(
                store, engine, agent, trial_plan, on_task_done=task_done,
                escalation=Escalation(cfg.safeguards.escalate_model, escalate)
                if escalate is not None and cfg.safeguards.escalate_model
                else None,
            )  # fmt: skip
            stopped = await loop.run(tasks)
            ended = {"how": "stopped", "reason": stopped} if stopped else {"how": "finished"}
        except (asyncio.CancelledError, KeyboardInterrupt) as exc:
            ended = {"how": "interrupted", "by": type(exc).__name__}
            raise
        except Exception as exc:
            ended = {"how": "crashed", "error": f"{type(exc).__name__}: {exc}"[:500]}
            raise
        finally:
            progress.close()
            envs.close()
            pool.close()
            actor.close()
            if reflector is not actor:
                reflector.close()
            for client in extra.values():
                client.close()  # its backend is the plan's, closed with it
            try:
                _record_end(store, time.time() - started, ended, stopped)
            except RunStoreError as exc:
                if ended["how"] == "finished":
                    raise
                # the error that ended the run (a full disk, say) is the one to report; the
                # store then reads as a kill -9 would leave it, and a resume goes on from there
                log.warning("how the run ended was not recorded: %s", exc)
            finally:
                store.close()
    return run_dir


def _record_end(store: RunStore, wall_s: float, ended: dict[str, Any], stopped: str | None) -> None:
    """The process's wall time and how it ended (episodes left in play become interrupted;
    whether the run is complete is the store's to derive)."""
    store.set_meta("wall_s", store.get_meta("wall_s", 0.0) + wall_s)
    if ended["how"] != "finished":
        left = store.mark_interrupted()  # their steps are kept: a resume continues them
        if left:
            ended["episodes_left"] = left
    if stopped:
        store.log_event("budget", str(stopped))
    store.log_event("end", json.dumps(ended))


CODE_FILES = ("prompts", "instruction_file", "reflection_template", "reflection_examples")


def code_prompts(cfg: RunConfig) -> CodePrompts | None:
    """The user's files of the reflexion-code protocol (None in reflexsim's own)."""
    p = cfg.protocol
    if p.protocol != CODE_PROTOCOL:
        return None
    if cfg.models.action_decoding != "free":
        raise ConfigError(
            f"--protocol {CODE_PROTOCOL} takes the model's text as the code does: "
            f"--action-decoding free, not {cfg.models.action_decoding}"
        )
    missing = [n for n in CODE_FILES if not getattr(p, n)]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise ConfigError(f"--protocol {CODE_PROTOCOL} needs the wording files: {flags}")
    assert p.prompts and p.instruction_file and p.reflection_template and p.reflection_examples
    try:
        return CodePrompts.load(
            p.prompts, p.instruction_file, p.reflection_template, p.reflection_examples
        )
    except PromptFileError as exc:
        raise ConfigError(str(exc)) from None


def prompt_file_hashes(cfg: RunConfig) -> dict[str, str]:
    """sha256 of every prompt file the user gave (and of the protocol's layout file)."""
    p = cfg.protocol
    out = {n: _file_hash(Path(getattr(p, n))) for n in CODE_FILES if getattr(p, n)}
    if p.protocol == CODE_PROTOCOL:
        out["layout"] = sha256(layout_text())
    return out


def _instruction(cfg: RunConfig) -> str | None:
    path = cfg.protocol.instruction_file
    if path is None:
        return None
    try:
        return read_wording(path, "instruction file")
    except PromptFileError as exc:
        raise ConfigError(str(exc)) from None


def reflexion_settings(cfg: RunConfig) -> ReflexionSettings:
    return ReflexionSettings(
        protocol=cfg.protocol.protocol,
        code_prompts=code_prompts(cfg),
        instruction=_instruction(cfg),
        memory_size=cfg.protocol.memory_size,
        reflect_model=cfg.models.reflector,
        reflect_max_tokens=cfg.models.reflect_max_tokens,
        prompts_file=cfg.protocol.prompts,
        seed=cfg.protocol.seed,
        reflection_format=cfg.safeguards.reflection_format,
        reflection_max_chars=cfg.safeguards.reflection_max_chars,
    )


def trial_plan_of(cfg: RunConfig) -> TrialPlan:
    """How many trials, the arm's memory and reflection settings, and the safeguards."""
    guards = cfg.safeguards
    return TrialPlan(
        trials=cfg.protocol.trials,
        reflexion=reflexion_settings(cfg),
        memory=arms.get(cfg.protocol.agent).memory,
        llm_judge=cfg.evaluation.evaluator == "llm",
        safeguards=Safeguards(
            task_max_tokens=guards.task_max_tokens,
            task_max_seconds=guards.task_max_seconds,
            oscillation_stop=guards.oscillation_stop,
            escalate_model=guards.escalate_model,
        ),
    )


def build_agent(
    cfg: RunConfig, log: SearchLog | None = None, truth: GroundTruth = NO_GROUND_TRUTH
) -> Agent:
    """The arm's agent, built by its registered factory (a search agent's tree goes to ``log``;
    ``truth``: the games' solutions, for the arms whose value function may read them)."""
    context = ArmContext(actor_settings(cfg), reflexion_settings(cfg), cfg, log, truth)
    return arms.get(cfg.protocol.agent).build(context)


def _extra_backends(cfg: RunConfig, truth: GroundTruth = NO_GROUND_TRUTH) -> dict[str, Backend]:
    """The planner and escalation models, when they are models of their own (built with the
    actor, so a bad spec or a missing API key is refused before the run directory is written)."""
    out: dict[str, Backend] = {}
    specs = {"planner": cfg.planning.planner_model, "escalate": cfg.safeguards.escalate_model}
    try:
        for role, spec in specs.items():
            if spec and spec != cfg.models.model:
                out[role] = make_backend(spec, ground_truth=truth, **_backend_options(cfg))
    except BaseException:
        _close_all(list(out.values()))
        raise
    return out


def grounding_rules(cfg: RunConfig) -> GroundingRules:
    """The rewrites of the model's action: none in the reflexion-code protocol but the one it is
    asked for; put X in/on Y -> move X to Y is ALFWorld 0.4's syntax (TextWorld keeps `put`)."""
    if cfg.protocol.protocol == CODE_PROTOCOL:
        return replace(GroundingRules.none(), put_to_move=cfg.protocol.code_put_to_move)
    if cfg.protocol.grounding:
        return GroundingRules(put_to_move=cfg.gameset.env == "alfworld")
    return GroundingRules.none()


def actor_settings(cfg: RunConfig) -> ActorSettings:
    return ActorSettings(
        generation=generation_config(cfg),
        evaluator=make_evaluator(
            cfg.evaluation.evaluator,
            count_thoughts=cfg.protocol.count_thoughts,
            max_actions=cfg.evaluation.max_actions,
            max_repeats=cfg.evaluation.max_repeats,
            exact=cfg.protocol.protocol == CODE_PROTOCOL,
        ),
        grounding=grounding_rules(cfg),
        max_steps=cfg.protocol.max_steps,
        count_thoughts=cfg.protocol.count_thoughts,
        decoding=cfg.models.action_decoding,
        protocol=cfg.protocol.protocol,
    )


def _yaml(tree: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(tree, sort_keys=False))


def run(
    cfg: RunConfig,
    resume: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
    lock: DirLock | None = None,
) -> Path:
    """Prepare and execute a run (or resume one); returns the run directory (its store says
    how it ended: ``RunStore.run_state``). ``lock``: the run directory's, already held."""
    return execute(prepare(cfg, resume=resume, force=force, lock=lock), progress)


def dry_run_plan(cfg: RunConfig) -> dict[str, Any]:
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
    reflects = arms.get(cfg.protocol.agent).memory.reflects
    reflections = n * (cfg.protocol.trials - 1) if reflects else 0
    return {
        "model": cfg.models.model,
        "reflect_model": cfg.models.reflector,
        "arm": cfg.protocol.agent,
        "evaluator": cfg.evaluation.evaluator,
        "env": cfg.gameset.env,
        "games": n,
        **games,
        "trials": cfg.protocol.trials,
        "max_steps": cfg.protocol.max_steps,
        "memory_size": cfg.protocol.memory_size,
        "estimated_requests": {
            "actor_steps_at_most": n * cfg.protocol.trials * cfg.protocol.max_steps,
            "reflections_at_most": reflections,
            "judge_calls_at_most": n * cfg.protocol.trials
            if cfg.evaluation.evaluator == "llm"
            else 0,
        },
        "config": cfg.to_dict(public=True),
    }
