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

import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from envs.errors import EnvError
from envs.pool import (
    START_TIMEOUT_S,
    Call,
    EnvPool,
    EnvSpec,
    _apply,
    _portable,
    resolve_kind,
    steps_first,
)

log = logging.getLogger("envs.ray_pool")

# A new actor may first wait for CPUs that other runs hold: a longer start allowance.
RAY_START_TIMEOUT_S = max(START_TIMEOUT_S, 300.0)


def import_ray() -> Any:
    """The ``ray`` module, or an EnvError naming the install command."""
    try:
        import ray  # lazily: ray is an optional extra
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
        import ray  # lazily: ray is an optional extra

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
    """One actor: its handle, where it runs, and the futures of the calls it owes, in the order
    they were sent (an actor answers in that order)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.started = time.monotonic()
        self.ready = False  # it has answered once
        self.where: dict[str, Any] = {}
        self.ping: Any = None  # the future of its first call, which says where it runs
        self.futures: deque[Any] = deque()


class RayEnvPool(EnvPool):
    """Envs in ``workers`` Ray actors, ``slots`` episodes in flight (default: one per worker).

    :class:`envs.pool.EnvPool` with actors in place of processes: the same bookkeeping, API and
    failure semantics (its ``submit``, ``collect`` and ``call_many`` run unchanged; this class
    sends the calls, waits for the answers and replaces actors). Ray must be connected
    (``ray.init``) before a pool is made; ``on_close`` runs once the actors are gone.
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
        self._bookkeeping(spec, workers, timeout_s, slots)
        ray = import_ray()
        if not ray.is_initialized():
            raise EnvError("RayEnvPool needs a Ray connection: call ray.init(address) first")
        self._ray = ray
        self._remote = ray.remote(EnvActor).options(
            num_cpus=cpus_per_worker, max_restarts=0, scheduling_strategy="SPREAD"
        )
        self._on_close = on_close
        self._rfd, self._wfd = os.pipe()  # Ray's callbacks write a byte when an answer is there
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._actors = [self._start() for _ in range(self.workers)]

    # -- public --------------------------------------------------------------------------
    def pid(self, slot: int) -> int | None:
        """The process id of the actor that serves ``slot`` (once it has answered)."""
        pid = self._actors[self.worker_of(slot)].where.get("pid")
        return int(pid) if pid is not None else None

    def placement(self) -> list[dict[str, Any]]:
        """Where each actor runs (node id, host, pid), once it has answered."""
        self._pump(0.0)
        return [dict(a.where) for a in self._actors]

    def actor(self, slot: int) -> Any:
        """The Ray actor handle that serves ``slot`` now."""
        return self._actors[self.worker_of(slot)].handle

    def waitables(self) -> list[Any]:
        """The pipe Ray's callbacks write to, while calls are in flight."""
        return [self._rfd] if any(self._sent) else []

    def close(self) -> None:
        """Stop every actor (idempotent), then run ``on_close``."""
        if self._closed:
            return
        self._closed = True
        idle = [a.handle.close.remote() for i, a in enumerate(self._actors) if not self._sent[i]]
        try:
            self._ray.wait(idle, num_returns=len(idle), timeout=10.0)
        except Exception:
            pass
        for actor in self._actors:
            self._kill(actor)
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._on_close is not None:
            self._on_close()

    # -- internals (EnvPool's hooks) -----------------------------------------------------
    def _start(self) -> _Actor:
        actor = _Actor(self._remote.remote(self.spec))
        actor.ping = self._watch(actor.handle.where.remote())
        return actor

    def _watch(self, ref: Any) -> Any:
        future = ref.future()
        future.add_done_callback(self._wake)
        return future

    def _wake(self, _future: Any) -> None:
        """Ray's callback thread: wake whoever waits on the pipe."""
        try:
            os.write(self._wfd, b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _dispatch(self) -> None:
        """Send every queued call at once; an actor runs its calls one after another."""
        for index, queued in enumerate(self._outbox):
            actor = self._actors[index]
            batch = steps_first(queued)
            queued.clear()
            for slot, call in batch:
                if not self._sent[index]:
                    self._progress[index] = time.monotonic()
                self._sent[index].append((slot, call))
                actor.futures.append(self._watch(actor.handle.apply.remote(slot, call)))

    def _pump(self, wait_s: float | None) -> None:
        """Wait up to ``wait_s`` (None: until something happens) for answers and timeouts,
        and handle them: answers to their slots, dead and overdue actors replaced."""
        busy = [self._deadline(i) for i in range(self.workers) if self._sent[i]]
        until = max(0.0, min(busy) - time.monotonic()) if busy else None
        if wait_s is not None:
            until = wait_s if until is None else min(until, wait_s)
        if busy or wait_s:
            select.select([self._rfd], [], [], until)
        try:
            while os.read(self._rfd, 4096):
                pass
        except OSError:  # nothing more to read
            pass
        for index, actor in enumerate(self._actors):
            self._answers(index, actor)
        now = time.monotonic()
        for index, actor in enumerate(self._actors):
            if self._sent[index] and now >= self._deadline(index):
                limit = self.timeout_s if actor.ready else RAY_START_TIMEOUT_S
                self._replace(index, f"timed out (no answer within {limit:g}s)")

    def _answers(self, index: int, actor: _Actor) -> None:
        """Hand out the answers actor ``index`` has given, in order; replace it if it died."""
        try:
            if actor.ping is not None and actor.ping.done():
                actor.where = dict(actor.ping.result())
                actor.ping = None
                actor.ready = True
                # the calls it holds have had no time of their own yet: their timeout starts now
                self._progress[index] = time.monotonic()
                log.info("env worker %d runs on node %s (%s)", index,
                         actor.where["node_id"][:12], actor.where["host"])  # fmt: skip
            while actor.futures and actor.futures[0].done():
                ok, payload = actor.futures[0].result()  # (True, EnvReply) or (False, error)
                actor.futures.popleft()
                slot, call = self._sent[index].popleft()
                actor.ready = True
                self._progress[index] = time.monotonic()
                self._ready[slot] = payload
                self._episodes.record(slot, call, payload)
        except Exception as exc:  # the actor is gone, and every call it owed
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            self._replace(index, f"died ({type(exc).__name__}: {first})")

    def _deadline(self, index: int) -> float:
        """EnvPool's, with a longer allowance for a new actor (it may wait for free CPUs)."""
        actor = self._actors[index]
        allowance = 0.0 if actor.ready else RAY_START_TIMEOUT_S
        return max(self._progress[index] + self.timeout_s, actor.started + allowance)

    def _kill(self, actor: _Actor) -> None:
        try:
            self._ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass

    def _replace(self, index: int, reason: str) -> None:
        """Kill actor ``index``, fail the calls it owed and the episodes it held, start a
        fresh one."""
        old = self._actors[index]
        self._kill(old)
        node = old.where.get("node_id", "")[:12] or "not placed yet"
        reason = f"Ray env worker {index} (node {node}) {reason}"
        log.warning("%s: replacing it", reason)
        owed = dict(self._sent[index])
        self._sent[index].clear()
        for slot in self._slots_on(index):  # the slots this actor served
            if slot in owed:
                self._ready[slot] = crash = self._episodes.crashed(slot, reason, owed[slot])
                self._episodes.record(slot, owed[slot], crash)
            elif self._episodes.actions[slot] is not None and self._episodes.lost[slot] is None:
                self._episodes.lost[slot] = reason  # its next step reports the crash
        self._actors[index] = self._start()
        self.restarts += 1
