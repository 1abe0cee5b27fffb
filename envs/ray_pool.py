"""Env workers as Ray actors: the local pool's API (:class:`envs.pool.EnvPool`) across a cluster.

``RayEnvPool`` keeps ``slots`` episodes in flight on ``workers`` Ray actors, each reserving
``cpus_per_worker`` CPUs; Ray spreads them over the cluster's nodes. Slot ``s`` lives on actor
``s % workers``, which keeps one env per slot it serves, as a local worker process does. Every
call is sent at once and its answer handed back as it arrives: a Ray callback writes a byte to a
pipe, so :class:`envs.aio.AsyncEnvPool` waits on that pipe as it waits on a local worker's.

Every call has a timeout. An actor that dies (its node went away, it was killed) or overruns
the timeout is killed and replaced by a fresh one; each episode it held is reported as a
``WorkerCrashed`` carrying the actions it had taken, and the caller re-simulates it with
``Reset(game, replay=actions)``, exactly as with the local pool. Ray is imported here only, when
a pool is made (``pip install reflexsim[ray]``); every node needs the games at the same path.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from envs.errors import EnvError
from envs.pool import (
    START_TIMEOUT_S,
    Call,
    EnvSpec,
    Outcome,
    _apply,
    _check_calls,
    _Episodes,
    _PoolAPI,
    _portable,
    resolve_kind,
)

log = logging.getLogger("envs.ray_pool")

# A new actor may first wait for CPUs that other runs hold: a longer start allowance.
RAY_START_TIMEOUT_S = max(START_TIMEOUT_S, 300.0)
_PING = -1  # the slot of an actor's first call, which says where it runs


def import_ray() -> Any:
    """The ``ray`` module, or an EnvError naming the install command."""
    try:
        import ray
    except ImportError:
        raise EnvError("Ray is not installed: pip install reflexsim[ray]") from None
    return ray


class EnvActor:
    """What runs inside one Ray actor: the envs of the slots it serves."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.envs: dict[int, Any] = {}
        try:
            resolve_kind(spec.kind)  # the env's module loads under the start allowance
        except EnvError:
            pass  # the first reset reports it

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def apply(self, slot: int, call: Call) -> tuple[bool, Any]:
        try:
            return True, _apply(self.envs, self.spec, slot, call)
        except Exception as exc:
            return False, _portable(exc)

    def close(self) -> None:
        for env in self.envs.values():
            try:
                env.close()
            except Exception:
                pass
        self.envs.clear()


class _Actor:
    """One actor and the calls it owes, in the order they were sent."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.started = time.monotonic()
        self.progress = self.started
        self.ready = False
        self.where: dict[str, Any] = {}
        self.sent: deque[int] = deque()  # call ids


class RayEnvPool(_PoolAPI):
    """Envs in ``workers`` Ray actors, ``slots`` episodes in flight (default: one per worker).

    The API and the failure semantics are :class:`envs.pool.EnvPool`'s; Ray must be connected
    (``ray.init``) before a pool is made. ``on_close`` runs once the actors are gone.
    """

    def __init__(
        self,
        spec: EnvSpec,
        workers: int,
        timeout_s: float = 60.0,
        slots: int | None = None,
        cpus_per_worker: float = 1.0,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if workers < 1:
            raise EnvError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise EnvError(f"timeout_s must be > 0, got {timeout_s}")
        slots = workers if slots is None else slots
        if slots < 1:
            raise EnvError(f"slots must be >= 1, got {slots}")
        ray = import_ray()
        if not ray.is_initialized():
            raise EnvError("RayEnvPool needs a Ray connection: call ray.init(address) first")
        resolve_kind(spec.kind)  # fail here, not in every actor
        self._ray = ray
        self.spec = spec
        self.workers = min(workers, slots)
        self.slots = slots
        self.timeout_s = float(timeout_s)
        self.restarts = 0
        self._remote = ray.remote(EnvActor).options(
            num_cpus=cpus_per_worker, max_restarts=0, scheduling_strategy="SPREAD"
        )
        self._on_close = on_close
        self._episodes = _Episodes(slots)
        self._calls: dict[int, tuple[int, int, Call, Any, Any]] = {}  # id: worker, slot, call,
        self._ids = itertools.count()  # ref, future
        self._done: deque[int] = deque()  # ids whose future completed (Ray's callback thread)
        self._ready: dict[int, Outcome] = {}
        self._busy: set[int] = set()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._closed = False
        self._actors: list[_Actor] = []
        for index in range(self.workers):
            self._actors.append(_Actor(None))
            self._start_at(index)

    # -- public --------------------------------------------------------------------------
    def worker_of(self, slot: int) -> int:
        """The index of the actor that serves ``slot``."""
        return slot % self.workers

    def placement(self) -> list[dict[str, Any]]:
        """Where each actor runs (node id, host, pid), once it has answered."""
        return [dict(a.where) for a in self._actors]

    def actor(self, slot: int) -> Any:
        """The Ray actor handle that serves ``slot`` now."""
        return self._actors[self.worker_of(slot)].handle

    def actions(self, slot: int) -> tuple[str, ...]:
        """The actions slot's episode has taken since its last reset."""
        return tuple(self._episodes.actions[slot] or ())

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._busy)

    def waitables(self) -> list[Any]:
        """The pipe Ray's callbacks write to while calls are in flight."""
        return [self._rfd] if self._calls or self._done else []

    def next_deadline(self) -> float | None:
        busy = [self._deadline(a) for a in self._actors if a.sent]
        return min(busy) if busy else None

    def submit(self, calls: Mapping[int, Call]) -> None:
        """Send resets (``Reset``) and steps (action strings) without waiting for them."""
        if self._closed:
            raise EnvError("this RayEnvPool is closed: create a new one")
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
                self._send(self.worker_of(slot), slot, call)

    def collect(self, timeout: float | None = None) -> dict[int, Outcome]:
        """The answers that have arrived, waiting up to ``timeout`` seconds (None: as long as
        it takes) for at least one; empty when nothing is in flight or the wait ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        self._pump()
        while not self._ready and self._owed():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._wait(left)
            self._pump()
        out, self._ready = self._ready, {}
        self._busy.difference_update(out)
        return out

    def call_many(self, calls: Mapping[int, Call]) -> dict[int, Outcome]:
        """Run resets and steps for the given slots concurrently; returns once every call is
        answered, failed or timed out."""
        self.submit(calls)
        self._pump()
        while not self._ready.keys() >= calls.keys():
            if not self._owed():
                raise RuntimeError("RayEnvPool lost track of a call (a bug): close and recreate it")
            self._wait(None)
            self._pump()
        out = {slot: self._ready.pop(slot) for slot in calls}
        self._busy.difference_update(out)
        return out

    def close(self) -> None:
        """Stop every actor (idempotent), then run ``on_close``."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        idle = [a.handle.close.remote() for a in self._actors if not a.sent]
        try:
            ray.wait(idle, num_returns=len(idle), timeout=10.0)
        except Exception:
            pass
        for actor in self._actors:
            self._kill(actor)
        self._calls.clear()
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._on_close is not None:
            self._on_close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals -----------------------------------------------------------------------
    def _send(self, index: int, slot: int, call: Call) -> None:
        actor = self._actors[index]
        if not actor.sent:
            actor.progress = time.monotonic()
        cid = next(self._ids)
        if slot == _PING:
            ref = actor.handle.where.remote()
        else:
            ref = actor.handle.apply.remote(slot, call)
        future = ref.future()
        self._calls[cid] = (index, slot, call, ref, future)
        actor.sent.append(cid)
        future.add_done_callback(lambda _f, cid=cid: self._wake(cid))

    def _wake(self, cid: int) -> None:
        """Ray's callback thread: note the answer, wake whoever waits on the pipe."""
        self._done.append(cid)
        try:
            os.write(self._wfd, b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _owed(self) -> bool:
        return any(a.sent for a in self._actors) or bool(self._done)

    def _wait(self, wait_s: float | None) -> None:
        deadline = self.next_deadline()
        until = None if deadline is None else max(0.0, deadline - time.monotonic())
        if wait_s is not None:
            until = wait_s if until is None else min(until, wait_s)
        select.select([self._rfd], [], [], until)

    def _pump(self) -> None:
        """Hand out every answer that has arrived; replace dead and overdue actors."""
        try:
            while os.read(self._rfd, 4096):
                pass
        except OSError:  # empty
            pass
        while self._done:
            cid = self._done.popleft()
            entry = self._calls.get(cid)
            if entry is None:
                continue  # a call of a replaced actor
            index, slot, call, _ref, future = entry
            actor = self._actors[index]
            try:
                answer = future.result()
            except Exception as exc:  # the actor is gone: this call fails with the others
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                self._replace(index, f"died ({type(exc).__name__}: {first})")
                continue
            del self._calls[cid]
            actor.sent.remove(cid)
            actor.ready = True
            actor.progress = time.monotonic()
            if slot == _PING:
                actor.where = dict(answer)
                log.info("env worker %d runs on node %s (%s)", index, answer["node_id"][:12],
                         answer["host"])  # fmt: skip
                continue
            outcome: Outcome = answer[1]  # (True, StepResult) or (False, the env's exception)
            self._ready[slot] = outcome
            self._episodes.record(slot, call, outcome)
        now = time.monotonic()
        for index, actor in enumerate(self._actors):
            if actor.sent and now >= self._deadline(actor):
                limit = self.timeout_s if actor.ready else RAY_START_TIMEOUT_S
                self._replace(index, f"timed out (no answer within {limit:g}s)")

    def _deadline(self, actor: _Actor) -> float:
        if not actor.ready:
            return actor.started + max(self.timeout_s, RAY_START_TIMEOUT_S)
        return actor.progress + self.timeout_s

    def _kill(self, actor: _Actor) -> None:
        try:
            self._ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass

    def _replace(self, index: int, reason: str) -> None:
        """Kill actor ``index``, fail the calls it held, and start a fresh one."""
        old = self._actors[index]
        self._kill(old)
        node = old.where.get("node_id", "")[:12] or "not yet placed"
        reason = f"Ray env worker {index} (node {node}) {reason}"
        log.warning("%s: replacing it", reason)
        for cid in old.sent:
            entry = self._calls.pop(cid, None)
            if entry is None or entry[1] == _PING:
                continue
            _, slot, call, _, _ = entry
            self._ready[slot] = self._episodes.crashed(slot, reason, call)
            self._episodes.record(slot, call, self._ready[slot])
        old.sent.clear()
        # every other episode on that actor went with it
        for slot in range(index, self.slots, self.workers):
            if self._episodes.actions[slot] is not None and self._episodes.lost[slot] is None:
                self._episodes.lost[slot] = reason
        self._start_at(index)
        self.restarts += 1

    def _start_at(self, index: int) -> None:
        """A fresh actor at ``index``; its first call says where Ray placed it."""
        self._actors[index] = _Actor(self._remote.remote(self.spec))
        self._send(index, _PING, "")
