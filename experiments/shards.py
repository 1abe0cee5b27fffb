"""One run over several runner processes (``--harness-procs N``): when one Python process cannot
feed the GPU, the run's games are dealt among N processes on this machine, which play them into
the run's one store.

The parent (the session's process) owns the run: its lock, its directory, its store's start and
end, its progress and its model server. It deals the tasks round robin (task i to process
i mod N), splits ``--concurrency`` and ``--workers`` among the processes (each gets at least
one of each), starts them (``spawn``: nothing of the parent's threads or handles is copied) and
waits. Each process builds its own model clients and env workers and plays its tasks' chains of
trials as one process would (:func:`experiments.runner.wire` and
:func:`~experiments.runner.trial_loop`), committing to the same SQLite file (WAL: commits take
turns). A task's chain never leaves its process, so a task's episodes, reflections and seeds are
those of a one-process run; a request's data-parallel rank comes from its game, so it is the
same in any process.

What stays the parent's, so that the run reads as one process's:

- **budgets**: every process puts what it used in shared memory, and each checks the run's
  total (what the store held at the start plus every process's share) before each call;
- **progress**: the processes send their steps, episodes and task ends to the parent in
  batches, which shows them as one run's;
- **the end**: the parent closes the trials no task can still join, marks the episodes left in
  play interrupted and records how the run ended. A process that dies (``kill -9``) or crashes
  stops the others (SIGTERM: they end as interrupted, keeping what they played) and the run ends
  as crashed, naming it; ``--resume`` plays the rest, with any number of processes. A process
  whose parent dies ends too (Linux: at once; elsewhere within a second).

Refused (one line, before anything starts): a model loaded in process (each process would load
its own; serve it: ``--serve`` or ``--base-url``), the paper code's protocol (its trial summary
counts every game of a trial), env workers on Ray, and ``--concurrency`` below N.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from agents.experience import Experience
from agents.llm.specs import parse_spec
from experiments.arming import backend_options, own_models
from experiments.config import RunConfig
from experiments.errors import ConfigError, InfraError
from experiments.games import GameSet
from experiments.progress import Progress, RunLog
from experiments.prompts import layout_class
from experiments.runner import (
    Backends,
    Budget,
    Plan,
    Play,
    Player,
    in_this_process,
    open_backends,
    trial_loop,
    wire,
)
from experiments.store import RunStore, Tokens
from experiments.trials import Task

log = logging.getLogger("reflexsim.shards")

IN_PROCESS_KINDS = ("vllm", "hf", "llamacpp", "embedded")  # a model loaded by the process
FLUSH_S = 0.2  # how often a process sends its progress to the parent
WATCH_S = 0.1  # how often the parent looks at its processes
STOP_GRACE_S = 60.0  # how long a stopped process has to end before it is killed


class HarnessProcessError(InfraError):
    """A runner process of a ``--harness-procs`` run died or crashed: what was played is kept,
    and ``--resume`` plays the rest."""


def check(cfg: RunConfig) -> None:
    """Refuse, in one line, what N processes cannot play as one run (nothing started yet)."""
    n = cfg.execution.harness_procs
    if n == 1:
        return
    if not cfg.server.serve:
        for role, spec in own_models(cfg).items():
            kind = parse_spec(spec).kind
            if kind in IN_PROCESS_KINDS and not (
                kind == "vllm" and backend_options(cfg, role).get("base_url")
            ):
                raise ConfigError(
                    f"--harness-procs {n}: the {role}'s model {spec!r} runs inside the process, "
                    "so each process would load its own copy: serve it (--serve, or a server's "
                    "--base-url), or use --harness-procs 1"
                )
    if layout_class(cfg.protocol.protocol).reads_trial_summary:
        raise ConfigError(
            f"--harness-procs {n}: the paper code's protocol counts every game of a trial in "
            "its reflections, which one process alone can do: use --harness-procs 1"
        )
    if cfg.cluster.env_workers_on_ray:
        raise ConfigError(
            f"--harness-procs {n} with env workers on Ray is not supported: use one or the other"
        )
    if cfg.execution.concurrency < n:
        raise ConfigError(
            f"--harness-procs {n} needs at least one episode in play per process: "
            f"--concurrency {n} or more (it is {cfg.execution.concurrency})"
        )


def player(cfg: RunConfig) -> Player:
    """Who plays the run: this process, or ``--harness-procs`` processes."""
    n = cfg.execution.harness_procs
    if n == 1:
        return in_this_process

    def in_processes(plan: Plan, store: RunStore, progress: Progress, stack: ExitStack) -> Play:
        return _Shards(plan, store, progress, n).play

    return in_processes


def share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split among ``parts`` as evenly as whole numbers go (at
    least 1)."""
    return max(1, total // parts + (index < total % parts))


def deal(tasks: Sequence[Task], parts: int) -> list[list[Task]]:
    """The tasks dealt round robin (task i to part i mod ``parts``); empty parts left out."""
    dealt = [list(tasks[i::parts]) for i in range(parts)]
    return [d for d in dealt if d]


# -- what the processes share ---------------------------------------------------------------
class SharedUsage:
    """What each process used since it began, in shared memory: process ``k`` writes its
    three counts, anyone sums them."""

    def __init__(self, context: Any, parts: int) -> None:
        self.array = context.Array("q", 3 * parts, lock=False)  # one writer per slot

    def put(self, index: int, used: Tokens) -> None:
        self.array[3 * index : 3 * index + 3] = [used.prompt, used.completion, used.cached_prompt]

    def total(self) -> Tokens:
        values = list(self.array)
        return Tokens(sum(values[0::3]), sum(values[1::3]), sum(values[2::3]))


@dataclass(frozen=True)
class ShardJob:
    """What one process needs to play its part (pickled to it)."""

    index: int
    count: int
    cfg: RunConfig  # its share of --concurrency and --workers
    run_dir: Path
    games: GameSet  # its tasks only
    experience: Experience | None
    used_before: Tokens  # what the store held when the processes started
    deadline: float | None  # the run's (--deadline), as the parent worked it out
    parent: int  # the parent's pid


# -- the parent -----------------------------------------------------------------------------
class _Shards:
    """The parent's side: start the processes, show their progress, stop them, end the run."""

    def __init__(self, plan: Plan, store: RunStore, progress: Progress, n: int) -> None:
        self.plan, self.store, self.progress = plan, store, progress
        self.context = multiprocessing.get_context("spawn")
        self.parts = deal(plan.games.tasks, n)
        self.messages: Any = self.context.Queue()
        self.usage = SharedUsage(self.context, len(self.parts))
        self.procs: list[BaseProcess] = []
        self.ends: dict[int, tuple[str, str | None]] = {}  # index -> (how, reason or error)
        self.failed: str | None = None  # the first process that died or crashed, in words
        self.used_before = store.token_totals()
        self.deadline = Budget(plan.cfg).deadline  # the run's, worked out once
        self.task_done: Callable[[Task, bool, int], None] = lambda task, won, trial: None

    def _job(self, index: int, tasks: list[Task]) -> ShardJob:
        cfg, k = self.plan.cfg, len(self.parts)
        ex = cfg.execution
        own = cfg.replace(
            concurrency=share(ex.concurrency, k, index), workers=share(ex.workers, k, index)
        )
        return ShardJob(
            index, k, own, self.plan.run_dir, replace(self.plan.games, tasks=tasks),
            self.plan.experience, self.used_before, self.deadline, os.getpid(),
        )  # fmt: skip

    async def play(self, task_done: Callable[[Task, bool, int], None]) -> str | None:
        self.task_done = task_done
        self.store.reopen_tasks()  # each task's end is recorded again, by its process
        try:
            for index, tasks in enumerate(self.parts):
                proc = self.context.Process(
                    target=play_shard,
                    args=(self._job(index, tasks), self.messages, self.usage),
                    name=f"reflexsim-runner-{index + 1}",
                    daemon=False,
                )
                proc.start()
                self.procs.append(proc)
            self.store.log_event(
                "harness_procs",
                json.dumps(
                    {"pids": [p.pid for p in self.procs], "tasks": [len(t) for t in self.parts]}
                ),
            )
            while len(self.ends) < len(self.procs):
                self._drain()
                self._watch()
                await asyncio.sleep(WATCH_S)
            self._drain()
        finally:
            self._stop_all(wait=True)
            self._close_trials()
        if self.failed is not None:
            raise HarnessProcessError(
                f"{self.failed}; the other runner processes were stopped: what was played is "
                f"kept; --resume {self.plan.run_dir} plays the rest"
            )
        stops = [reason for how, reason in self.ends.values() if how == "stopped" and reason]
        return stops[0] if stops else None

    def _drain(self) -> None:
        """Show what the processes sent; note each one's end."""
        while True:
            try:
                message = self.messages.get_nowait()
            except queue.Empty:
                return
            kind, index, body = message
            if kind == "progress":
                self._show(body)
            elif kind == "end":
                how, detail = body
                self.ends[index] = (how, detail)
                if how in ("crashed", "interrupted") and self.failed is None:
                    self.failed = f"runner process {index + 1} of {len(self.parts)} {how}" + (
                        f" ({detail})" if detail else ""
                    )
                    self._stop_all(wait=False)

    def _show(self, events: list[tuple[Any, ...]]) -> None:
        for event in events:
            if event[0] == "step":
                self.progress.step_done(event[1])
            elif event[0] == "episode":
                tokens = (self.used_before + self.usage.total()).total
                self.progress.episode_done(event[1], tokens, event[2])
            elif event[0] == "task":
                self.task_done(event[1], event[2], event[3])

    def _watch(self) -> None:
        """A process that is gone without saying how it ended died: the others are stopped."""
        for index, proc in enumerate(self.procs):
            if proc.exitcode is None or index in self.ends:
                continue
            self._drain()  # what it sent before it went
            if index in self.ends:
                continue
            code = proc.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self.ends[index] = ("died", how)
            if self.failed is None:
                self.failed = f"runner process {index + 1} of {len(self.parts)} died ({how})"
            self._stop_all(wait=False)

    def _stop_all(self, wait: bool) -> None:
        """SIGTERM to every process still running (each ends as interrupted); ``wait``: until
        they are gone (killed after STOP_GRACE_S)."""
        for proc in self.procs:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid or 0, signal.SIGTERM)
        if not wait:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.exitcode is None:
                log.warning("runner process %s did not stop: killed", proc.name)
                proc.kill()
                proc.join()
        self._drain()

    def _close_trials(self) -> None:
        """Record the end of every trial no task can still join (as one process does as it
        goes)."""
        ended = self.store.task_ends()
        at: dict[str, int] = {}
        for e in self.store.episodes():
            at[e.game] = max(at.get(e.game, 0), e.trial)
        lowest = min(
            (at.get(t.game, 0) for t in self.plan.games.tasks if t.game not in ended),
            default=float("inf"),
        )
        for row in self.store.trial_rows():
            if row.finished_at is None and row.trial < lowest:
                self.store.finish_trial(row.trial)


# -- a process ------------------------------------------------------------------------------
class _Forward:
    """A process's progress, sent to the parent in batches."""

    def __init__(self, messages: Any, index: int) -> None:
        self.messages, self.index = messages, index
        self.events: list[tuple[Any, ...]] = []

    def begin(self, summary: dict[str, Any]) -> None:
        pass

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        pass

    def step_done(self, episode: str) -> None:
        self.events.append(("step", episode))

    def episode_done(self, won: bool, tokens: int, episode: str = "") -> None:
        self.events.append(("episode", won, episode))

    def task_done(self, won: bool, episodes_saved: int) -> None:
        pass  # the parent's, from the task ends sent by ``task_ended``

    def task_ended(self, task: Task, won: bool, trial: int) -> None:
        """The trial loop's callback for a task's end."""
        self.events.append(("task", task, won, trial))

    def close(self) -> None:
        self.flush()

    def flush(self) -> None:
        if self.events:
            events, self.events = self.events, []
            self.messages.put(("progress", self.index, events))


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def play_shard(job: ShardJob, messages: Any, usage: SharedUsage) -> None:
    """A runner process: play ``job``'s tasks into the run's store; say how it ended."""
    _die_with_parent()
    if os.getppid() != job.parent:  # the parent died before the line above
        return
    how: tuple[str, str | None] = ("crashed", None)
    try:
        with RunLog(job.run_dir):  # its log lines (a crash's traceback too) go to run.log
            how = _play_here(job, messages, usage)
    except (KeyboardInterrupt, asyncio.CancelledError):
        how = ("interrupted", None)
    except BaseException as exc:
        how = ("crashed", f"{type(exc).__name__}: {exc}"[:500])
    messages.put(("end", job.index, how))
    messages.close()
    messages.join_thread()


def _play_here(job: ShardJob, messages: Any, usage: SharedUsage) -> tuple[str, str | None]:
    """How this process's play ended: ("finished", None) or ("stopped", why)."""
    try:
        backends = open_backends(job.cfg, job.games.ground_truth)
        try:
            store = RunStore(job.run_dir, check=False)
            try:
                stopped = asyncio.run(_play(job, store, backends, messages, usage))
            finally:
                store.close()
        finally:
            backends.close()
    except Exception:
        log.exception("runner process %d of %d crashed", job.index + 1, job.count)
        raise
    return ("stopped", stopped) if stopped else ("finished", None)


async def _play(
    job: ShardJob, store: RunStore, backends: Backends, messages: Any, usage: SharedUsage
) -> str | None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    forward = _Forward(messages, job.index)
    plan = Plan(job.cfg, job.run_dir, job.games, {}, backends, True, job.experience)
    with ExitStack() as stack:
        stack.callback(forward.close)
        engine, clients = wire(plan, store, forward, stack)
        began = engine.usage
        budget = Budget(job.cfg)
        budget.deadline = job.deadline  # the parent's: not a moment later in each process

        def should_stop(used: Tokens) -> str | None:
            usage.put(job.index, used - began)
            return budget(job.used_before + usage.total())

        engine.should_stop = should_stop
        flusher = asyncio.ensure_future(_flush(forward, job.parent))
        stack.callback(flusher.cancel)
        chains = trial_loop(plan, store, engine, clients, forward.task_ended, whole_run=False)
        return await chains.run(job.games.tasks)


async def _flush(forward: _Forward, parent: int) -> None:
    """Send the progress every FLUSH_S; end the process when its parent is gone."""
    while True:
        await asyncio.sleep(FLUSH_S)
        forward.flush()
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
