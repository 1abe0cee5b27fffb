"""The env pool on an asyncio event loop: ``await envs.call(slot, call)``, no threads, no ticks.

Each call is submitted to the pool at once; the loop watches the busy workers' pipes and
sentinels (``loop.add_reader``) and the earliest call timeout (``loop.call_later``), and hands
every answer to its own awaiting episode the moment it arrives. A slow reset therefore holds up
only the episode that asked for it. Works over :class:`~envs.pool.EnvPool` and
:class:`~envs.pool.SyncEnvPool` (whose calls complete inside ``submit``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from envs.pool import Call, Outcome


class AsyncEnvPool:
    """Awaitable calls over a pool; one call in flight per slot, as the pool requires."""

    def __init__(self, pool: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.pool = pool
        self.slots: int = pool.slots
        self._loop = loop
        self._waiting: dict[int, asyncio.Future[Outcome]] = {}
        self._watched: set[Any] = set()
        self._watched_restarts = -1  # the pool's restarts when the readers were registered
        self._timer: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def call(self, slot: int, call: Call) -> Outcome:
        """Submit one reset (``Reset``) or step (an action) for ``slot`` and await its answer
        (an ``EnvReply``, a ``WorkerCrashed``, or the exception the env raised)."""
        future: asyncio.Future[Outcome] = self.loop.create_future()
        self._waiting[slot] = future
        try:
            self.pool.submit({slot: call})
            self._hand(self.pool.answered())  # its answer comes through the readers
            self._watch()
            return await future
        finally:
            self._waiting.pop(slot, None)

    def _collect(self) -> None:
        self._hand(self.pool.collect(0.0))
        self._watch()

    def _hand(self, outcomes: dict[int, Outcome]) -> None:
        for slot, outcome in outcomes.items():
            future = self._waiting.get(slot)
            if future is not None and not future.done():
                future.set_result(outcome)

    def _watch(self) -> None:
        """Wait on exactly what the pool is busy with now. The readers change only when the
        busy descriptors do, or when a worker was replaced (its successor may reuse its
        descriptor numbers); the timer only when the earliest deadline comes sooner (a timer
        that fires early finds nothing and is set again)."""
        watched = set(self.pool.waitables())
        restarts = getattr(self.pool, "restarts", 0)
        if watched != self._watched or restarts != self._watched_restarts:
            for fd in self._watched:
                self.loop.remove_reader(fd)
            self._watched, self._watched_restarts = watched, restarts
            for fd in self._watched:
                self.loop.add_reader(fd, self._collect)
        deadline = self.pool.next_deadline()
        if deadline is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        when = self.loop.time() + max(0.0, deadline - time.monotonic()) + 0.01
        if self._timer is not None and self._timer.when() <= when:
            return  # it fires first: its _collect sets the next one
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._collect()

    def close(self) -> None:
        """Stop watching (the caller closes the pool)."""
        if self._loop is not None:
            for fd in self._watched:
                self._loop.remove_reader(fd)
        self._watched = set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
