"""One run over several runner processes (``--harness-procs N``): when one Python process cannot
feed the GPU, the run's games are dealt among N processes on this machine, which play them into
the run's one store.

The parent (the session's process) owns the run: its lock, its directory, its store's start and
end, its progress and its model server. It deals the tasks round robin (task i to process
i mod N), splits ``--concurrency`` and ``--workers`` among the processes (each gets at least
one of each), starts them and waits. They are its children (``spawn``: nothing of the parent's
threads or handles is copied), or with ``--harness-procs-on-ray`` Ray actors of a CPU each,
placed on the parent's node: the store is one SQLite file, which only the processes of one
machine may write. Each process builds its own model clients and env workers and plays its
tasks' chains of trials as one process would (:func:`experiments.runner.wire` and
:func:`~experiments.runner.trial_loop`), committing to the same SQLite file (WAL: commits take
turns). A task's chain never leaves its process, so a task's episodes, reflections and seeds are
those of a one-process run; a request's data-parallel rank comes from its game, so it is the
same in any process.

What stays the parent's, so that the run reads as one process's:

- **budgets**: every process puts what it used on a board (a small file each process maps,
  removed once all have mapped it: a parent killed with ``kill -9`` leaves no file behind), and
  each checks the run's total (what the store held at the start plus every process's share)
  before each call;
- **progress**: the processes send their steps, episodes and task ends to the parent in
  batches (a multiprocessing queue; on Ray, Ray's queue), which shows them as one run's;
- **the end**: the parent closes the trials no task can still join, marks the episodes left in
  play interrupted and records how the run ended. A process that dies (``kill -9``) or crashes
  stops the others (the board's word to stop, and SIGTERM to its children: they end as
  interrupted, keeping what they played) and the run ends as crashed, naming it; ``--resume``
  plays the rest, with any number of processes. A process whose parent dies ends too (Linux: at
  once; elsewhere within a second; a Ray actor: when Ray ends it with its owner).

Refused (one line, before anything starts): a model loaded in process (each process would load
its own; serve it: ``--serve`` or ``--base-url``), the paper code's protocol (its trial summary
counts every game of a trial), env workers on Ray and ``--concurrency`` below N. On Ray, a node
with fewer than N CPUs is a one-line error too, once connected: the run has played nothing, and
``--resume`` with fewer processes plays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import mmap
import multiprocessing
import multiprocessing.queues
import os
import queue
import signal
import sys
import tempfile
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
from experiments.ray_session import alive_nodes, session
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
START_S = 120.0  # how long Ray has to start the runner processes


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
        launch: _Local | _OnRay = _Local()
        if cfg.cluster.harness_procs_on_ray:
            address = cfg.cluster.address
            assert address is not None  # the config's own check
            launch = _OnRay(stack.enter_context(session(address)))
        return _Shards(plan, store, progress, n, launch).play

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
class Board:
    """What the processes share, in a small file each process of this machine maps (a runner
    process on Ray inherits nothing from the parent): each process's token use since it began
    (three counts, one writer each) and the parent's word to stop. It pickles as its path."""

    def __init__(self, path: Path, parts: int) -> None:
        self.path, self.parts = path, parts
        with open(path, "r+b") as file:  # the map outlives the file's handle
            self._map = mmap.mmap(file.fileno(), 8 * (3 * parts + 1))
        self._values = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, parts: int) -> Board:
        fd, name = tempfile.mkstemp(prefix="reflexsim-shards-")
        with os.fdopen(fd, "wb") as file:
            file.write(bytes(8 * (3 * parts + 1)))
        return cls(Path(name), parts)

    def __reduce__(self) -> tuple[type[Board], tuple[Path, int]]:
        return (Board, (self.path, self.parts))

    def put(self, index: int, used: Tokens) -> None:
        at = 3 * index
        self._values[at], self._values[at + 1] = used.prompt, used.completion
        self._values[at + 2] = used.cached_prompt

    def total(self) -> Tokens:
        values = self._values.tolist()[: 3 * self.parts]
        return Tokens(sum(values[0::3]), sum(values[1::3]), sum(values[2::3]))

    def stop(self) -> None:
        self._values[3 * self.parts] = 1

    @property
    def stopping(self) -> bool:
        return self._values[3 * self.parts] != 0

    def unlink(self) -> None:
        """Remove the file (the maps stay): once every process has mapped it, so that a parent
        killed with ``kill -9`` leaves nothing in the temporary folder."""
        self.path.unlink(missing_ok=True)

    def close(self, remove: bool = False) -> None:
        self._values.release()
        self._map.close()
        if remove:
            self.unlink()


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
    parent: int | None  # the parent's pid (None: a Ray actor, which Ray ends with its owner)


# -- how the processes are started ----------------------------------------------------------
class _Local:
    """Runner processes started here (``spawn``: nothing of the parent's threads or handles is
    copied), watched by their exit codes, stopped with SIGTERM."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.messages: Any = self.context.Queue()
        self.procs: list[BaseProcess] = []
        self.where: dict[str, str] = {}  # no Ray node to name

    @property
    def parent(self) -> int | None:
        return os.getpid()

    def start(self, jobs: list[ShardJob], board: Board) -> list[int]:
        for job in jobs:
            proc = self.context.Process(
                target=play_shard,
                args=(job, self.messages, board),
                name=f"reflexsim-runner-{job.index + 1}",
                daemon=False,
            )
            proc.start()
            self.procs.append(proc)
        return [p.pid or 0 for p in self.procs]

    def gone(self, index: int) -> str | None:
        """None while process ``index`` runs; how it ended once it is gone."""
        code = self.procs[index].exitcode
        if code is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid or 0, signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.exitcode is None:
                log.warning("runner process %s did not stop: killed", proc.name)
                proc.kill()
                proc.join()


class _Actor:
    """A runner process as a Ray actor."""

    def pid(self) -> int:
        return os.getpid()

    def play(self, job: ShardJob, messages: Any, board: Board) -> None:
        play_shard(job, messages, board)


class _OnRay:
    """Runner processes as Ray actors (``--harness-procs-on-ray``), on the node of this process:
    the run's store is one SQLite file, which only the processes of one machine may write.
    Watched through their calls; stopped by the board's word (killed after a grace)."""

    def __init__(self, ray: Any) -> None:
        from ray.util.queue import Queue  # lazily: ray is an optional extra
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ray = ray
        self.node = ray.get_runtime_context().get_node_id()
        self.here = NodeAffinitySchedulingStrategy(node_id=self.node, soft=False)
        self.where = {"ray_node": self.node}
        self.messages: Any = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": self.here})
        self.actors: list[Any] = []
        self.calls: list[Any] = []

    @property
    def parent(self) -> int | None:
        return None

    def start(self, jobs: list[ShardJob], board: Board) -> list[int]:
        mine = [n for n in alive_nodes(self.ray) if n["NodeID"] == self.node]
        cpus = mine[0].get("Resources", {}).get("CPU", 0.0) if mine else 0.0
        if cpus < len(jobs):
            raise ConfigError(
                f"--harness-procs {len(jobs)} on Ray reserves a CPU for each process on this "
                f"node, which has {cpus:g}: use fewer processes, or leave out "
                "--harness-procs-on-ray"
            )
        remote = self.ray.remote(_Actor).options(
            num_cpus=1, scheduling_strategy=self.here, max_restarts=0
        )
        self.actors = [remote.remote() for _ in jobs]
        try:
            pids = self.ray.get([a.pid.remote() for a in self.actors], timeout=START_S)
        except self.ray.exceptions.GetTimeoutError:
            raise HarnessProcessError(
                f"Ray started no {len(jobs)} runner processes on this node in {START_S:g} s "
                "(each reserves a CPU): free CPUs there, or leave out --harness-procs-on-ray"
            ) from None
        self.calls = [
            a.play.remote(job, self.messages, board)
            for a, job in zip(self.actors, jobs, strict=True)
        ]
        return list(pids)

    def gone(self, index: int) -> str | None:
        call = self.calls[index]
        ready, _ = self.ray.wait([call], timeout=0)
        if not ready:
            return None
        try:
            self.ray.get(call)
        except self.ray.exceptions.RayActorError:
            return "its Ray actor died"
        except self.ray.exceptions.RayError as exc:
            return f"{type(exc).__name__}"
        return "exit code 0"

    def stop(self) -> None:
        pass  # the board's word

    def wait(self, timeout_s: float) -> None:
        _, left = self.ray.wait(self.calls, num_returns=len(self.calls), timeout=timeout_s)
        for index, (call, actor) in enumerate(zip(self.calls, self.actors, strict=True)):
            if call in left:
                log.warning("runner process %d (a Ray actor) did not stop: killed", index + 1)
            self.ray.kill(actor)  # its CPU back to the cluster now, not when Ray collects it


# -- the parent -----------------------------------------------------------------------------
class _Shards:
    """The parent's side: start the processes, show their progress, stop them, end the run."""

    def __init__(
        self, plan: Plan, store: RunStore, progress: Progress, n: int, launch: _Local | _OnRay
    ) -> None:
        self.plan, self.store, self.progress, self.launch = plan, store, progress, launch
        self.parts = deal(plan.games.tasks, n)
        self.ends: dict[int, tuple[str, str | None]] = {}  # index -> (how, reason or error)
        self.failed: str | None = None  # the first process that died or crashed, in words
        self.used_before = store.token_totals()
        self.deadline = Budget(plan.cfg).deadline  # the run's, worked out once
        self.board = Board.create(len(self.parts))
        self.mapped: set[int] = set()  # the processes that mapped the board
        self.task_done: Callable[[Task, bool, int], None] = lambda task, won, trial: None

    def _job(self, index: int, tasks: list[Task]) -> ShardJob:
        cfg, k = self.plan.cfg, len(self.parts)
        ex = cfg.execution
        own = cfg.replace(
            concurrency=share(ex.concurrency, k, index), workers=share(ex.workers, k, index)
        )
        return ShardJob(
            index, k, own, self.plan.run_dir, replace(self.plan.games, tasks=tasks),
            self.plan.experience, self.used_before, self.deadline, self.launch.parent,
        )  # fmt: skip

    async def play(self, task_done: Callable[[Task, bool, int], None]) -> str | None:
        self.task_done = task_done
        self.store.reopen_tasks()  # each task's end is recorded again, by its process
        started = False
        try:
            jobs = [self._job(index, tasks) for index, tasks in enumerate(self.parts)]
            pids = self.launch.start(jobs, self.board)
            started = True
            tasks = [len(t) for t in self.parts]
            self.store.log_event(
                "harness_procs", json.dumps({"pids": pids, "tasks": tasks, **self.launch.where})
            )
            while len(self.ends) < len(self.parts):
                self._drain()
                self._watch()
                await asyncio.sleep(WATCH_S)
            self._drain()
        finally:
            if started:
                self._stop_all(wait=True)
            self.board.close(remove=True)
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
                message = self.launch.messages.get_nowait()
            except queue.Empty:  # Ray's queue raises a subclass of it
                return
            kind, index, body = message
            if kind == "progress":
                self._show(body)
            elif kind == "mapped":
                self.mapped.add(index)
                if len(self.mapped) == len(self.parts):
                    self.board.unlink()  # every process holds its map: nothing left to leak
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
                tokens = (self.used_before + self.board.total()).total
                self.progress.episode_done(event[1], tokens, event[2])
            elif event[0] == "task":
                self.task_done(event[1], event[2], event[3])

    def _watch(self) -> None:
        """A process that is gone without saying how it ended died: the others are stopped."""
        for index in range(len(self.parts)):
            if index in self.ends:
                continue
            how = self.launch.gone(index)
            if how is None:
                continue
            self._drain()  # what it sent before it went
            if index in self.ends:
                continue
            self.ends[index] = ("died", how)
            if self.failed is None:
                self.failed = f"runner process {index + 1} of {len(self.parts)} died ({how})"
            self._stop_all(wait=False)

    def _stop_all(self, wait: bool) -> None:
        """Tell every process still running to stop (each ends as interrupted); ``wait``: until
        they are gone (killed after STOP_GRACE_S)."""
        self.board.stop()
        self.launch.stop()
        if wait:
            self.launch.wait(STOP_GRACE_S)
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


def play_shard(job: ShardJob, messages: Any, board: Board) -> None:
    """A runner process: play ``job``'s tasks into the run's store; say how it ended."""
    if job.parent is not None:
        _die_with_parent()
        if os.getppid() != job.parent:  # the parent died before the line above
            return
    messages.put(("mapped", job.index, None))  # the board was mapped as the job arrived
    how: tuple[str, str | None] = ("crashed", None)
    try:
        with RunLog(job.run_dir):  # its log lines (a crash's traceback too) go to run.log
            how = _play_here(job, messages, board)
    except (KeyboardInterrupt, asyncio.CancelledError):
        how = ("interrupted", None)
    except BaseException as exc:
        how = ("crashed", f"{type(exc).__name__}: {exc}"[:500])
    messages.put(("end", job.index, how))
    board.close()
    if isinstance(messages, multiprocessing.queues.Queue):  # sent before the process ends
        messages.close()
        messages.join_thread()


def _play_here(job: ShardJob, messages: Any, board: Board) -> tuple[str, str | None]:
    """How this process's play ended: ("finished", None) or ("stopped", why)."""
    try:
        backends = open_backends(job.cfg, job.games.ground_truth)
        try:
            store = RunStore(job.run_dir, check=False)
            try:
                stopped = asyncio.run(_play(job, store, backends, messages, board))
            finally:
                store.close()
        finally:
            backends.close()
    except Exception:
        log.exception("runner process %d of %d crashed", job.index + 1, job.count)
        raise
    return ("stopped", stopped) if stopped else ("finished", None)


async def _play(
    job: ShardJob, store: RunStore, backends: Backends, messages: Any, board: Board
) -> str | None:
    task = asyncio.current_task()
    assert task is not None
    with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: the board's word
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    forward = _Forward(messages, job.index)
    plan = Plan(job.cfg, job.run_dir, job.games, {}, backends, True, job.experience)
    with ExitStack() as stack:
        stack.callback(forward.close)
        engine, clients = wire(plan, store, forward, stack)
        began = engine.usage
        budget = Budget(job.cfg)
        budget.deadline = job.deadline  # the parent's: not a moment later in each process

        def should_stop(used: Tokens) -> str | None:
            board.put(job.index, used - began)
            return budget(job.used_before + board.total())

        engine.should_stop = should_stop
        flusher = asyncio.ensure_future(_flush(forward, job.parent, board, task))
        stack.callback(flusher.cancel)
        chains = trial_loop(plan, store, engine, clients, forward.task_ended, whole_run=False)
        return await chains.run(job.games.tasks)


async def _flush(
    forward: _Forward, parent: int | None, board: Board, play: asyncio.Task[Any]
) -> None:
    """Send the progress every FLUSH_S; stop the play when the parent says so or is gone."""
    while True:
        await asyncio.sleep(FLUSH_S)
        forward.flush()
        if board.stopping or (parent is not None and os.getppid() != parent):
            play.cancel()
