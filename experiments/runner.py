"""One run's wiring: ``execute(plan, store)`` plays a resolved run (env pool, model clients,
engine, trial loop, budgets, progress, run log) into its store. What comes before and after (run
directory, resume, games, manifest, lock, model server) is :mod:`experiments.session`'s."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.experience import Experience
from agents.llm import make_backend
from agents.llm.base import Backend
from agents.llm.common import check_grounding
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from envs.aio import AsyncEnvPool
from envs.pool import EnvPool, EnvSpec
from experiments.arming import (
    backend_options,
    build_agent,
    extra_backends,
    own_models,
    prompt_layout,
    routes,
    trial_plan_of,
)
from experiments.config import RunConfig, parse_deadline
from experiments.engine import Engine, ModelClient, Usage
from experiments.errors import RunStoreError
from experiments.games import GameSet
from experiments.progress import NoProgress, Progress, RunLog
from experiments.ray_session import ray_env_pool
from experiments.store import RunStore
from experiments.trials import Escalation, Task, TrialLoop
from memory.files import write_text

log = logging.getLogger("reflexsim.runner")


def make_backends(cfg: RunConfig, truth: GroundTruth = NO_GROUND_TRUTH) -> tuple[Backend, Backend]:
    actor = make_backend(cfg.models.model, ground_truth=truth, **backend_options(cfg))
    if "reflect" not in own_models(cfg):
        return actor, actor
    try:
        return actor, make_backend(
            cfg.models.reflector, ground_truth=truth, **backend_options(cfg, "reflect")
        )
    except BaseException:
        actor.close()
        raise


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
            cost = usage.cost_usd(self.model)
            if cost >= self.cfg.budget_usd:
                return f"cost budget ${self.cfg.budget_usd} reached (${cost:.4f})"
        return None


@dataclass(frozen=True)
class Backends:
    """The run's models: the actor, the reflector (often the same backend), and the arm's own
    roles' and escalation's models, if any."""

    actor: Backend
    reflector: Backend
    extras: dict[str, Backend] = field(default_factory=dict)  # the arm's roles, escalate: own

    def close(self) -> None:
        _close_all([self.actor, self.reflector, *self.extras.values()])


def open_backends(cfg: RunConfig, truth: GroundTruth = NO_GROUND_TRUTH) -> Backends:
    """Every model the run uses, built and checked (a bad spec, a missing API key or a backend
    that cannot constrain actions is refused here, before the run directory is written)."""
    actor, reflector = make_backends(cfg, truth)
    try:
        backends = Backends(actor, reflector, extra_backends(cfg, truth))
    except BaseException:
        _close_all([actor, reflector])
        raise
    if cfg.models.action_decoding == "grounded":
        try:
            check_grounding(actor)  # a backend that cannot constrain: one line naming nearest
        except BaseException:
            backends.close()
            raise
    return backends


@dataclass(frozen=True)
class Plan:
    """A run resolved once: config, games, run dir, manifest and the model backends."""

    cfg: RunConfig
    run_dir: Path
    games: GameSet
    manifest: dict[str, Any]
    backends: Backends
    resumed: bool
    experience: Experience | None = None  # other games' experience the run shows


def _close_all(backends: list[Backend]) -> None:
    """Close each backend once (the actor often doubles as the reflector)."""
    for backend in {id(b): b for b in backends}.values():
        backend.close()


# plays a wired run's tasks and returns why it stopped early (None: complete); given the
# callback for a task's end (see :func:`_progress_start`)
Play = Callable[[Callable[[Task, bool, int], None]], Awaitable[str | None]]
# wires one run's play: (plan, store, progress, what closes what it opens) -> its Play
Player = Callable[[Plan, RunStore, Progress, ExitStack], Play]


def execute(
    plan: Plan, store: RunStore, progress: Progress | None = None, player: Player | None = None
) -> None:
    """Play a prepared run to its end (or its budget) into ``store``, which records how it
    ended. The plan's backends and the store stay open: their owner closes them. ``player``:
    who plays the tasks (default: this process, :func:`in_this_process`; several processes:
    :mod:`experiments.shards`)."""
    asyncio.run(_execute(plan, store, progress or NoProgress(), player or in_this_process))


async def _execute(plan: Plan, store: RunStore, progress: Progress, player: Player) -> None:
    _begin(plan, store, progress)
    ending = _Ending(store)
    with ExitStack() as stack:
        stack.enter_context(RunLog(plan.run_dir))
        stack.callback(ending.record)  # runs once everything registered after it is closed
        play = player(plan, store, progress, stack)
        task_done = _progress_start(plan, store, progress)
        stack.callback(progress.close)
        if not plan.resumed:  # a resume's own event (in _begin) marks where its process began
            store.log_event("start", json.dumps({"pid": os.getpid()}))
        with ending:
            ending.stopped = await play(task_done)


def in_this_process(plan: Plan, store: RunStore, progress: Progress, stack: ExitStack) -> Play:
    """Every task played here: one engine over the env pool and the model clients."""
    engine, clients = wire(plan, store, progress, stack)

    async def play(task_done: Callable[[Task, bool, int], None]) -> str | None:
        return await trial_loop(plan, store, engine, clients, task_done).run(plan.games.tasks)

    return play


def _begin(plan: Plan, store: RunStore, progress: Progress) -> None:
    """The run's start in its store and directory (the manifest, config.yaml); the summary
    ``progress`` shows."""
    cfg, run_dir = plan.cfg, plan.run_dir
    if plan.resumed:
        differences = plan.manifest.get("resume_differences", [])
        store.log_event(
            "resume", json.dumps({"differences": differences, "forced": bool(differences)})
        )
    store.set_meta("manifest", plan.manifest)
    write_text(run_dir / "config.yaml", _yaml(cfg.to_tree(public=True)))
    progress.begin(
        {
            "run_dir": str(run_dir),
            "resumed": plan.resumed,
            "model": cfg.models.model,
            "arm": cfg.protocol.agent,
            "games": len(plan.games.tasks),
            "game_source": plan.games.source,
            "trials": cfg.protocol.trials,
            "max_steps": cfg.protocol.max_steps,
            "concurrency": cfg.execution.concurrency,
            "workers": cfg.execution.workers,
            "harness_procs": cfg.execution.harness_procs,
            "config_file": str(run_dir / "config.yaml"),
            "config": cfg.to_tree(public=True),
        }
    )


def wire(
    plan: Plan, store: RunStore, progress: Progress, stack: ExitStack
) -> tuple[Engine, dict[str, ModelClient]]:
    """The engine, over a model client per backend (by role: actor, reflector, the arm's own
    roles, escalate) and the env pool; ``stack`` closes each (the backends are the plan's
    owner's)."""
    cfg, backends = plan.cfg, plan.backends
    in_flight = cfg.execution.concurrency

    def client(backend: Backend) -> ModelClient:
        return stack.enter_context(closing(ModelClient(backend, max_in_flight=in_flight)))

    actor = client(backends.actor)
    clients = {
        "actor": actor,
        "reflector": actor if backends.reflector is backends.actor else client(backends.reflector),
        **{role: client(backend) for role, backend in backends.extras.items()},
    }
    engine = Engine(
        store,
        actor,
        _env_pool(cfg, plan.games, stack),
        arm=cfg.protocol.agent,
        reflector=clients["reflector"],
        routes={p: clients[r] for p, r in routes(cfg).items() if r in clients},
        should_stop=Budget(cfg),
        concurrency=cfg.execution.concurrency,
        on_episode_done=lambda spec, end: progress.episode_done(
            bool(end and end.won), engine.usage.total, spec.episode_id
        ),
        on_step=lambda spec: progress.step_done(spec.episode_id),
    )
    return engine, clients


def _env_pool(cfg: RunConfig, games: GameSet, stack: ExitStack) -> AsyncEnvPool:
    """The env workers (processes here, or Ray actors across the cluster), closed by ``stack``."""

    spec = EnvSpec(games.env_kind, games.env_kwargs)
    # a spare slot per worker: an episode resets its game there while it waits for its turn
    slots = min(cfg.execution.concurrency + cfg.execution.workers, max(len(games.tasks), 1))
    pool: Any
    if cfg.cluster.env_workers_on_ray:  # the same API; the actors run across the cluster
        pool = ray_env_pool(cfg, spec, slots)
    else:
        pool = EnvPool(
            spec, workers=cfg.execution.workers, slots=slots, timeout_s=cfg.execution.step_timeout_s
        )
    stack.callback(pool.close)
    return stack.enter_context(closing(AsyncEnvPool(pool)))


def _progress_start(
    plan: Plan, store: RunStore, progress: Progress
) -> Callable[[Task, bool, int], None]:
    """Tell ``progress`` what is left to play; returns the trial loop's callback for a task's
    end (a task solved before this process began is not counted again)."""
    cfg, tasks = plan.cfg, plan.games.tasks
    episodes = store.episodes()
    solved_before = {e.game for e in episodes if e.won}
    remaining = sum(
        cfg.protocol.trials - len([e for e in episodes if e.game == t.game])
        for t in tasks
        if t.game not in solved_before
    )
    progress.start(len(tasks), remaining, len(solved_before))

    def task_done(task: Task, won: bool, trial: int) -> None:
        if task.game not in solved_before:
            progress.task_done(won, cfg.protocol.trials - 1 - trial)

    return task_done


def trial_loop(
    plan: Plan,
    store: RunStore,
    engine: Engine,
    clients: dict[str, ModelClient],
    task_done: Callable[[Task, bool, int], None],
    whole_run: bool = True,
) -> TrialLoop:
    """The arm's agent over the engine, trial after trial; a task that fails goes to the
    escalation model when one is set (the actor's own client when it is the same model).
    ``whole_run``: False where the loop plays only some of the run's tasks."""
    cfg = plan.cfg
    escalate = clients.get("escalate")
    if escalate is None and cfg.safeguards.escalate_model == cfg.models.model:
        escalate = clients["actor"]  # the same model again: its own client
    layout = prompt_layout(cfg)  # the wording files read once
    agent = build_agent(cfg, store, plan.games.ground_truth, layout)
    return TrialLoop(
        store, engine, agent, replace(trial_plan_of(cfg, layout), experience=plan.experience),
        on_task_done=task_done,
        whole_run=whole_run,
        escalation=Escalation(cfg.safeguards.escalate_model, escalate)
        if escalate is not None and cfg.safeguards.escalate_model
        else None,
    )  # fmt: skip


class _Ending:
    """How this process's part of a run ended (``with`` around the play), recorded in the store
    by :meth:`record` once what the run used is closed."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.began: float | None = None  # None: the play never began
        self.stopped: str | None = None  # the budget or deadline that stopped it
        self.ended: dict[str, Any] = {"how": "crashed"}

    def __enter__(self) -> None:
        self.began = time.time()

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.ended = (
                {"how": "stopped", "reason": self.stopped} if self.stopped else {"how": "finished"}
            )
        elif isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            self.ended = {"how": "interrupted", "by": type(exc).__name__}
        elif isinstance(exc, Exception):
            self.ended = {"how": "crashed", "error": f"{type(exc).__name__}: {exc}"[:500]}

    def record(self) -> None:
        if self.began is None:
            return
        try:
            _record_end(self.store, time.time() - self.began, self.ended, self.stopped)
        except RunStoreError as exc:
            if self.ended["how"] == "finished":
                raise
            # the error that ended the run (a full disk, say) is the one to report; the
            # store then reads as a kill -9 would leave it, and a resume goes on from there
            log.warning("how the run ended was not recorded: %s", exc)


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


def _yaml(tree: dict[str, Any]) -> str:
    import yaml  # lazily: PyYAML costs ~25 ms; only reading or writing YAML needs it

    return str(yaml.safe_dump(tree, sort_keys=False))
