"""Run many episodes at once: envs in worker processes, stepped concurrently.

``EnvPool`` keeps ``slots`` episodes in flight on ``workers`` processes. Slot ``s`` lives on
worker ``s % workers``, which keeps one env per slot it serves and reuses it across that slot's
games. Memory therefore grows with slots, never with games played (an ALFWorld engine holds its
own copy of fast-downward's library, so engines are never created per game), and a slot never
has to reload and replay its game because another slot on the same worker moved: reloading costs
a second or more per switch, an extra engine a few tens of MB. The default is one slot per
worker.

Every call has a timeout. A worker that dies or overruns it is killed and replaced by a fresh one;
each episode it held is reported as a ``WorkerCrashed`` carrying the actions the episode had taken
(the pool records them per slot since the last reset), so the caller can re-simulate it with
``reset(slot, game, replay=crash.actions)`` and carry on. ``SyncEnvPool`` has the same API and runs
the envs in-process, so a runner has one code path for 1 worker, debugging and tests.

Workers import nothing heavy until an env needs it: ``envs.alfworld_env`` loads TextWorld on the
first reset.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import pickle
import select
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal, Self

from envs import ENV_KINDS
from envs.errors import EnvError
from memory.records import EnvReply

# A fresh worker gets at least this long to start (spawning an interpreter on a busy machine).
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EnvSpec:
    """How a worker builds its env: a kind ("alfworld", "textworld" or "module:callable") and the
    constructor's keyword arguments (data_dir, split, task_types, max_steps, ...). Picklable."""

    kind: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a plain dict pickles whatever Mapping the caller passed
        object.__setattr__(self, "kwargs", dict(self.kwargs))

    def build(self) -> Any:
        """Construct the env this spec describes (imports its module now)."""
        return resolve_kind(self.kind)(**self.kwargs)


@dataclass(frozen=True)
class Reset:
    """A reset request for a batched call: start ``game`` (None: the seed picks one), then
    re-simulate ``replay`` so the reply is the state after those actions."""

    game: str | None = None
    seed: int | None = None
    replay: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.replay, str):
            raise EnvError("replay must be a sequence of actions, not one string")
        object.__setattr__(self, "replay", tuple(str(a) for a in self.replay))


class WorkerCrashed(Exception):
    """The worker holding this slot's episode died or timed out; the episode is lost.

    ``actions`` are the actions it had completed (re-simulate them with
    ``reset(slot, game, replay=actions)``); ``pending`` is the action that was in flight, if any
    (its outcome is unknown: retry it after the replay).
    """

    def __init__(
        self,
        slot: int,
        actions: Sequence[str],
        reason: str,
        game: str | None = None,
        pending: str | None = None,
    ) -> None:
        self.slot = slot
        self.actions: tuple[str, ...] = tuple(actions)
        self.reason = reason
        self.game = game
        self.pending = pending
        super().__init__(
            f"slot {slot}: {reason}; the episode ({game or 'no game'}) was interrupted after "
            f"{len(self.actions)} actions: re-simulate it with reset(slot, game, replay=actions)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.slot, self.actions, self.reason, self.game, self.pending))


Call = str | Reset  # a step's action, or a reset
Outcome = EnvReply | Exception  # a WorkerCrashed, or the exception the env raised


def resolve_kind(kind: str) -> Callable[..., Any]:
    """The env constructor a kind names; a clear EnvError if it cannot be found."""
    known = ENV_KINDS.get(kind)
    target = known.entry_point if known is not None else kind
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(
            f"unknown env kind {kind!r}: use one of {', '.join(ENV_KINDS)} or 'module:callable'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"env kind {kind!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvError(f"env kind {kind!r}: {module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


# -- what both pools share ---------------------------------------------------------------------
class _Episodes:
    """Per-slot bookkeeping in the parent: the game and the actions since the last reset."""

    def __init__(self, slots: int) -> None:
        self.games: list[str | None] = [None] * slots
        self.actions: list[list[str] | None] = [None] * slots  # None: no episode in this slot
        self.lost: list[str | None] = [None] * slots  # why the episode was lost, if it was

    def check(self, slot: int, call: Call) -> Exception | None:
        """An error to answer at once instead of sending the call, or None."""
        if isinstance(call, Reset):
            return None
        if self.lost[slot] is not None:
            return self.crashed(slot, str(self.lost[slot]), pending=call)
        if self.actions[slot] is None:
            return EnvError(f"slot {slot} has no episode: call reset(slot, game) before step")
        return None

    def crashed(self, slot: int, reason: str, pending: Call | None) -> WorkerCrashed:
        if isinstance(pending, Reset):
            # the reset never finished: report what it was asked to replay
            return WorkerCrashed(slot, pending.replay, reason, pending.game, None)
        return WorkerCrashed(slot, self.actions[slot] or (), reason, self.games[slot], pending)

    def record(self, slot: int, call: Call, outcome: Outcome) -> None:
        if isinstance(outcome, WorkerCrashed):
            self.lost[slot] = outcome.reason
            return
        if isinstance(call, Reset):
            self.lost[slot] = None
            if isinstance(outcome, EnvReply):
                self.actions[slot] = list(call.replay)
                self.games[slot] = str(outcome.info.get("game", call.game))
            else:  # a failed reset leaves no episode to step
                self.actions[slot] = None
                self.games[slot] = None
            return
        if isinstance(outcome, EnvReply):
            actions = self.actions[slot]
            assert actions is not None
            actions.append(call)


def steps_first(queued: Iterable[tuple[int, Call]]) -> list[tuple[int, Call]]:
    """Queued (slot, call) pairs in the order a worker runs them: steps (milliseconds each, and
    a model call waits on every one) before resets (a game's first reset takes most of a
    second). A slot has one call at a time, so no slot's own order changes."""
    return sorted(queued, key=lambda item: isinstance(item[1], Reset))


def _check_calls(calls: Mapping[int, Call], slots: int) -> None:
    for slot, call in calls.items():
        if not isinstance(slot, int) or not 0 <= slot < slots:
            raise EnvError(f"slot {slot!r} is out of range: this pool has slots 0..{slots - 1}")
        if not isinstance(call, (str, Reset)):
            raise EnvError(f"slot {slot}: a call is an action string or a Reset, got {call!r}")


def _apply(envs: dict[int, Any], spec: EnvSpec, slot: int, call: Call) -> EnvReply:
    """Run one call against the slot's env (built on its first reset)."""
    if isinstance(call, Reset):
        env = envs.get(slot)
        if env is None:
            env = envs[slot] = spec.build()
        options = {"game": call.game} if call.game is not None else None
        obs, info = env.reset(seed=call.seed, options=options)
        result = EnvReply(obs, info=dict(info))
        for action in call.replay:
            result = EnvReply(*env.step(action))
        return result
    env = envs.get(slot)
    if env is None:
        raise EnvError(f"slot {slot} has no env: call reset(slot, game) before step")
    return EnvReply(*env.step(call))


class _PoolAPI:
    """The calls both pools offer; each pool implements submit, collect, call_many, close."""

    slots: int

    def submit(self, calls: Mapping[int, Call]) -> None:
        raise NotImplementedError

    def waitables(self) -> list[Any]:
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        raise NotImplementedError

    def collect(self, timeout: float | None = None) -> dict[int, Outcome]:
        raise NotImplementedError

    def answered(self) -> dict[int, Outcome]:
        """The answers already here, handed back without asking any worker (a call refused at
        once, answers read while collecting others)."""
        raise NotImplementedError

    def call_many(self, calls: Mapping[int, Call]) -> dict[int, Outcome]:
        raise NotImplementedError

    def reset(
        self, slot: int, game: str | None, seed: int | None = None, replay: Sequence[str] = ()
    ) -> EnvReply:
        """Start ``game`` in ``slot`` (re-simulating ``replay`` first); raises on failure."""
        return _raise_or_return(self.call_many({slot: Reset(game, seed, tuple(replay))})[slot])

    def step(self, slot: int, action: str) -> EnvReply:
        """One step in one slot; raises WorkerCrashed or the env's own error."""
        return _raise_or_return(self.call_many({slot: action})[slot])

    def step_many(self, actions: Mapping[int, str]) -> dict[int, Outcome]:
        """Step all given slots concurrently; returns when all answered or timed out."""
        return self.call_many(actions)

    def reset_many(self, resets: Mapping[int, Reset]) -> dict[int, Outcome]:
        """Reset all given slots concurrently."""
        return self.call_many(resets)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


def _raise_or_return(outcome: Outcome) -> EnvReply:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


# -- in-process -----------------------------------------------------------------------------------
class SyncEnvPool(_PoolAPI):
    """The pool's API with the envs in this process, one per slot, called one after another.

    ``submit`` runs the calls at once; no timeout applies and nothing can crash. Use it for a
    single worker, debugging and tests.
    """

    def __init__(self, spec: EnvSpec, slots: int = 1) -> None:
        if slots < 1:
            raise EnvError(f"slots must be >= 1, got {slots}")
        resolve_kind(spec.kind)
        self.spec = spec
        self.slots = slots
        self._envs: dict[int, Any] = {}
        self._episodes = _Episodes(slots)
        self._ready: dict[int, Outcome] = {}

    @property
    def in_flight(self) -> frozenset[int]:
        """Slots with a submitted call whose answer has not been collected yet."""
        return frozenset(self._ready)

    def submit(self, calls: Mapping[int, Call]) -> None:
        """Run resets (``Reset``) and steps (action strings) now; ``collect`` hands them back."""
        _check_calls(calls, self.slots)
        busy = sorted(self._ready.keys() & calls.keys())
        if busy:
            raise EnvError(f"slot {busy[0]} already has a call in flight: collect() it first")
        for slot, call in calls.items():
            early = self._episodes.check(slot, call)
            if early is not None:
                self._ready[slot] = early
                continue
            outcome: Outcome
            try:
                outcome = _apply(self._envs, self.spec, slot, call)
            except Exception as exc:
                outcome = exc
            self._episodes.record(slot, call, outcome)
            self._ready[slot] = outcome

    def collect(self, timeout: float | None = None) -> dict[int, Outcome]:
        """Every answer not yet handed back (never waits: submit already ran them)."""
        return self.answered()

    def answered(self) -> dict[int, Outcome]:
        out, self._ready = self._ready, {}
        return out

    def call_many(self, calls: Mapping[int, Call]) -> dict[int, Outcome]:
        """Run resets (``Reset``) and steps (action strings) for the given slots."""
        self.submit(calls)
        return {slot: self._ready.pop(slot) for slot in calls}

    def actions(self, slot: int) -> tuple[str, ...]:
        """The actions slot's episode has taken since its last reset."""
        return tuple(self._episodes.actions[slot] or ())

    def waitables(self) -> list[Any]:
        """Nothing to wait on: ``submit`` already ran the calls."""
        return []

    def next_deadline(self) -> float | None:
        return None

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()


# -- worker processes -----------------------------------------------------------------------------
_READABLE = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(sources: Sequence[Any], timeout: float | None) -> list[Any]:
    """Those of ``sources`` (connections, or file descriptors such as a process sentinel) that
    can be read, or are closed, within ``timeout`` seconds (None: until one can): what
    ``multiprocessing.connection.wait`` answers, with one ``poll`` call and no selector to build
    (the engine asks this after every env call)."""
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for source in sources:
        fd = source if isinstance(source, int) else source.fileno()
        by_fd[fd] = source
        poller.register(fd, _READABLE)
    ms = None if timeout is None else math.ceil(timeout * 1000)
    return [by_fd[fd] for fd, _ in poller.poll(ms)]


def _portable(exc: Exception) -> Exception:
    """The exception itself if it survives pickling, else a RuntimeError naming it."""
    if not isinstance(exc, EnvError):
        # an unexpected error: keep the worker's traceback for whoever debugs it
        exc.add_note("in the env worker:\n" + "".join(traceback.format_exception(exc)))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        portable = RuntimeError(f"{type(exc).__name__}: {exc}")
        for note in getattr(exc, "__notes__", ()):
            portable.add_note(note)
        return portable


def _worker_main(conn: Connection, spec: EnvSpec) -> None:
    """A worker's loop: answer each call of a batch in order, one message per call."""
    # Ctrl-C (and a scheduler's SIGTERM) reach the whole process group; the parent decides
    # what happens to workers: it stops taking work, commits, then closes them (a parent killed
    # outright closes their pipe, and they exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    envs: dict[int, Any] = {}
    try:
        # the env's module (not its engine) loads under the start allowance, not a call's timeout
        resolve_kind(spec.kind)
    except EnvError:
        pass  # the first reset reports it
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if message[0] == "close":
            break
        for slot, call in message[1]:
            try:
                reply: tuple[Any, ...] = ("ok", slot, _apply(envs, spec, slot, call))
            except Exception as exc:
                reply = ("err", slot, _portable(exc))
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return
    for env in envs.values():
        try:
            env.close()
        except Exception:
            pass


class _Worker:
    def __init__(self, ctx: Any, spec: EnvSpec, index: int) -> None:
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_end, spec),
            name=f"reflexsim-env-{index}",
            daemon=True,
        )
        self.process.start()
        child_end.close()  # so that the worker's death reads as EOF here
        self.conn: Connection = parent_end
        self.started = time.monotonic()
        self.ready = False
        self._poller = select.poll()  # one, kept: asked after every answer read
        self._poller.register(parent_end.fileno(), _READABLE)

    def has_more(self) -> bool:
        """Whether the pipe can be read now (a message, or EOF) without waiting."""
        return bool(self._poller.poll(0))

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()


class EnvPool(_PoolAPI):
    """Envs in ``workers`` processes, ``slots`` episodes in flight (default: one per worker).

    Calls to different workers run concurrently. ``timeout_s`` bounds each call: a worker that
    does not answer in time, or dies, is killed and replaced; its episodes become
    ``WorkerCrashed`` (now, or on the slot's next call) and the other slots carry on.

    ``call_many`` (and ``step_many``, ``reset_many``) returns when every call it made is
    answered; ``submit`` + ``collect`` hand back each answer as soon as it arrives, so a slow
    call (a reset loads a game) never holds the other slots back.
    """

    def __init__(
        self,
        spec: EnvSpec,
        workers: int,
        timeout_s: float = 60.0,
        start_method: Literal["spawn", "forkserver"] | None = None,
        slots: int | None = None,
    ) -> None:
        self._bookkeeping(spec, workers, timeout_s, slots)
        if start_method is None:
            methods = multiprocessing.get_all_start_methods()
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        if start_method not in ("spawn", "forkserver"):
            # fork would copy the parent's threads and locks (HTTP clients, model backends)
            raise EnvError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        pickle.dumps(spec)
        self._ctx = multiprocessing.get_context(start_method)
        self._workers = [_Worker(self._ctx, spec, i) for i in range(self.workers)]

    def _bookkeeping(
        self, spec: EnvSpec, workers: int, timeout_s: float, slots: int | None
    ) -> None:
        """Check the sizes and set up what every pool tracks (a Ray pool shares it)."""
        if workers < 1:
            raise EnvError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise EnvError(f"timeout_s must be > 0, got {timeout_s}")
        slots = workers if slots is None else slots
        if slots < 1:
            raise EnvError(f"slots must be >= 1, got {slots}")
        resolve_kind(spec.kind)  # fail here, not in every worker
        self.spec = spec
        self.workers = min(workers, slots)  # a worker without a slot would only idle
        self.slots = slots
        self.timeout_s = float(timeout_s)
        self.restarts = 0
        self._episodes = _Episodes(slots)
        # per worker: calls waiting for it to finish its batch, and the batch it is working on
        self._outbox: list[deque[tuple[int, Call]]] = [deque() for _ in range(self.workers)]
        self._sent: list[deque[tuple[int, Call]]] = [deque() for _ in range(self.workers)]
        self._home = [slot % self.workers for slot in range(slots)]  # each slot's worker
        self._loaded_on: dict[str | None, int] = {}  # the worker each game was last reset on
        self._cold: dict[int, bool] = {}  # each slot's last reset: whether it loads its game anew
        self._progress = [0.0] * self.workers
        self._ready: dict[int, Outcome] = {}  # answered, not yet handed back
        self._busy: set[int] = set()  # submitted, not yet handed back
        self._workers = []  # a Ray pool has actors instead
        self._closed = False

    # -- public --------------------------------------------------------------------------
    def worker_of(self, slot: int) -> int:
        """The index of the worker that holds ``slot``'s episode (it may change at a reset)."""
        return self._home[slot]

    def pid(self, slot: int) -> int | None:
        """The process id of the worker that serves ``slot`` now."""
        return self._workers[self.worker_of(slot)].pid

    def actions(self, slot: int) -> tuple[str, ...]:
        """The actions slot's episode has taken since its last reset."""
        return tuple(self._episodes.actions[slot] or ())

    @property
    def in_flight(self) -> frozenset[int]:
        """Slots with a submitted call whose answer has not been collected yet."""
        return frozenset(self._busy)

    def waitables(self) -> list[Any]:
        """What an event loop waits on for answers and deaths: the busy workers' pipes and
        process sentinels (file descriptors); ``collect(0)`` handles whatever woke it."""
        out: list[Any] = []
        for i in range(self.workers):
            if self._sent[i]:
                out += [self._workers[i].conn.fileno(), self._workers[i].process.sentinel]
        return out

    def next_deadline(self) -> float | None:
        """The ``time.monotonic()`` at which the earliest busy worker times out, or None."""
        busy = [self._deadline(i) for i in range(self.workers) if self._sent[i]]
        return min(busy) if busy else None

    def submit(self, calls: Mapping[int, Call]) -> None:
        """Start resets (``Reset``) and steps (action strings) without waiting for them; a slot
        takes one call at a time (collect its answer before submitting the next)."""
        if self._closed:
            raise EnvError("this EnvPool is closed: create a new one")
        _check_calls(calls, self.slots)
        busy = sorted(self._busy.intersection(calls))
        if busy:
            raise EnvError(f"slot {busy[0]} already has a call in flight: collect() it first")
        for slot, call in calls.items():
            self._busy.add(slot)
            early = self._episodes.check(slot, call)
            if early is not None:
                self._ready[slot] = early
            else:
                self._outbox[self._place(slot, call)].append((slot, call))
        self._dispatch()

    def collect(self, timeout: float | None = None) -> dict[int, Outcome]:
        """The answers that have arrived, waiting up to ``timeout`` seconds (None: as long as
        it takes) for at least one; empty when nothing is in flight or the wait ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        pumped = False
        while not self._ready and any(self._sent):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._pump(left)
            pumped = True
        if not pumped:
            self._pump(0.0)  # pick up whatever has already arrived
        return self.answered()

    def answered(self) -> dict[int, Outcome]:
        out, self._ready = self._ready, {}
        self._busy.difference_update(out)
        return out

    def call_many(self, calls: Mapping[int, Call]) -> dict[int, Outcome]:
        """Run resets (``Reset``) and steps (action strings) for the given slots concurrently;
        returns once every call is answered, failed or timed out."""
        self.submit(calls)
        while not self._ready.keys() >= calls.keys():
            if not any(self._sent):
                raise RuntimeError("EnvPool lost track of a call (a bug): close and recreate it")
            self._pump(None)
        out = {slot: self._ready.pop(slot) for slot in calls}
        self._busy.difference_update(out)
        return out

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for index, worker in enumerate(self._workers):
            if self._sent[index]:  # busy (perhaps hung): its answers are no longer wanted
                worker.kill()
                continue
            try:
                worker.conn.send(("close",))
            except (OSError, EOFError):
                pass
        for worker in self._workers:
            worker.process.join(5.0)
            worker.kill()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals -----------------------------------------------------------------------
    def _place(self, slot: int, call: Call) -> int:
        """The worker a call goes to. A slot's steps go where its episode is; a reset that starts
        another game goes where it is answered soonest, as far as loads go: the worker with the
        fewest game loads waiting or running, this one included (a load translates the game:
        most of a second; a game the worker loaded last comes from its reset cache, and a step
        takes milliseconds), then the fewest calls, then the slot's own; the slot moves there,
        so that no worker idles while every episode it holds waits for the model and another
        worker has loads queued. A reset of the slot's own game (a restore, a re-simulation)
        stays, for the worker's reset cache. A worker keeps an env for each slot it has held (at
        most ``slots``)."""
        home = self._home[slot]
        if isinstance(call, Reset):
            kept = self._loaded_on.get(call.game)
            if call.game != self._episodes.games[slot]:
                load = [self._load(i) for i in range(self.workers)]
                self._home[slot] = min(
                    range(self.workers),
                    key=lambda i: (load[i][0] + (i != kept), load[i][1], i != home),
                )
            self._cold[slot] = call.game is None or kept != self._home[slot]
            if call.game is not None:
                self._loaded_on[call.game] = self._home[slot]
        return self._home[slot]

    def _load(self, index: int) -> tuple[int, int]:
        """How busy worker ``index`` is: the game loads waiting or running there (resets of a
        game it did not load last), then all its calls."""
        calls = [*self._outbox[index], *self._sent[index]]
        cold = sum(isinstance(c, Reset) and self._cold.get(slot, True) for slot, c in calls)
        return cold, len(calls)

    def _slots_on(self, index: int) -> list[int]:
        """The slots whose episodes live on worker ``index``."""
        return [slot for slot in range(self.slots) if self._home[slot] == index]

    def _dispatch(self) -> None:
        """Send each idle worker what waits for it, as one message: every step, then at most
        one reset (the others wait for the next batch, so that a step that comes meanwhile waits
        for one reset, not for all of them).

        One batch in flight per worker: the worker reads a batch whole before it answers, so
        neither side can block the other on a full pipe.
        """
        for index in range(self.workers):
            if self._sent[index] or not self._outbox[index]:
                continue
            queued = steps_first(self._outbox[index])
            resets = next((k for k, (_, c) in enumerate(queued) if isinstance(c, Reset)), None)
            batch = queued if resets is None else queued[: resets + 1]
            self._outbox[index].clear()
            self._outbox[index].extend(queued[len(batch) :])
            self._sent[index].extend(batch)
            self._progress[index] = time.monotonic()
            try:
                self._workers[index].conn.send(("batch", batch))
            except (OSError, EOFError):
                self._replace(index, "died")

    def _pump(self, wait_s: float | None) -> None:
        """Wait up to ``wait_s`` (None: until something happens) for answers, deaths and
        timeouts among the busy workers, and handle them."""
        active = [i for i in range(self.workers) if self._sent[i]]
        if not active:
            return
        # a worker's pipe (answers) and its sentinel (death) both wake us
        sources: dict[Any, int] = {}
        for i in active:
            sources[self._workers[i].conn] = i
            sources[self._workers[i].process.sentinel] = i
        now = time.monotonic()
        until = min(self._deadline(i) for i in active) - now
        if wait_s is not None:
            until = min(until, wait_s)
        woke: dict[int, bool] = {}  # index -> whether its sentinel (a death) woke us too
        for obj in readable(list(sources), max(0.0, until)):
            index = sources[obj]
            woke[index] = woke.get(index, False) or obj is self._workers[index].process.sentinel
        for index, sentinel in woke.items():
            if not self._drain(index, sentinel):
                self._replace(index, "died")
        now = time.monotonic()
        for index in active:
            if self._sent[index] and now >= self._deadline(index):
                limit = self.timeout_s if self._workers[index].ready else START_TIMEOUT_S
                self._replace(index, f"timed out (no answer within {limit:g}s)")
        self._dispatch()

    def _deadline(self, index: int) -> float:
        worker = self._workers[index]
        if not worker.ready:
            return worker.started + max(self.timeout_s, START_TIMEOUT_S)
        return self._progress[index] + self.timeout_s

    def _drain(self, index: int, sentinel: bool) -> bool:
        """Read every message the worker has sent; False if it died with calls unanswered
        (``sentinel``: its process sentinel was readable, so it may have; a worker that died
        with nothing unread in its pipe reads as EOF otherwise)."""
        worker = self._workers[index]
        sent = self._sent[index]
        try:
            while sent and worker.has_more():
                message = worker.conn.recv()
                self._progress[index] = time.monotonic()
                if message[0] == "ready":
                    worker.ready = True
                    continue
                _, slot, payload = message
                expected, call = sent.popleft()
                assert slot == expected, (slot, expected)
                self._ready[slot] = payload
                self._episodes.record(slot, call, payload)
        except (EOFError, OSError):
            return False
        return not sent or not sentinel or worker.process.is_alive()

    def _replace(self, index: int, reason: str) -> None:
        """Kill worker ``index``, fail the calls it held, and start a fresh one."""
        old = self._workers[index]
        old.kill()
        code = old.process.exitcode
        if reason == "died" and code is not None and code < 0:
            reason = f"died (signal {-code})"
        elif reason == "died" and code is not None:
            reason = f"died (exit code {code})"
        reason = f"env worker {old.pid} {reason}"
        for slot, call in self._sent[index]:
            self._ready[slot] = self._episodes.crashed(slot, reason, call)
            self._episodes.record(slot, call, self._ready[slot])
        self._sent[index].clear()
        # every other episode on that worker went with it
        for slot in self._slots_on(index):
            if self._episodes.actions[slot] is not None and self._episodes.lost[slot] is None:
                self._episodes.lost[slot] = reason
        # queued steps of those episodes are lost too; queued resets go to the new worker
        queued = list(self._outbox[index])
        self._outbox[index].clear()
        for slot, call in queued:
            early = self._episodes.check(slot, call)
            if early is not None:
                self._ready[slot] = early
            else:
                self._outbox[index].append((slot, call))
        self._workers[index] = _Worker(self._ctx, self.spec, index)
        self.restarts += 1
