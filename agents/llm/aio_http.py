"""JSON over keep-alive HTTP for the OpenAI-compatible backend: no thread per request and no
SDK on a request's path.

:class:`HttpClient` sends each attempt (:meth:`HttpClient.post`) on the event loop that awaits
it, with an ``aiohttp`` session of that loop's own (its "lane": session, width, the waits'
wake-up and the attempts in flight): the engine's loop awaits its requests itself, with no
thread and no hand-over between loops. A caller without a loop (:meth:`HttpClient.run`) has its
coroutine run on a loop of the client's own, in a thread started the first time one is needed.
A lane's session closes when its loop's ``asyncio.run`` ends (a keeper task closes it when that
run cancels what is left), or at :meth:`HttpClient.close`. At most ``width`` requests are in
flight on each loop. The proxy comes from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``,
``NO_PROXY``), read once for the server's URL (aiohttp's ``trust_env`` would read it, and
``~/.netrc``, in a thread for every request).

Each attempt has one deadline for all of it, ``timeout`` seconds: waiting for a pooled
connection, connecting, sending and reading the whole answer, so a server that trickles its
answer or never ends it cannot hold a request longer. A transport failure is a
:class:`~agents.llm.retry.Retryable` (``timeout``, ``connection error (...)``); an answer,
whatever its status, is returned as it came for the caller to judge.

:meth:`HttpClient.close` ends the attempts in flight at once (they fail as cancelled), ends the
waits between retries (:meth:`HttpClient.sleep`) and fails every later request before it is
sent.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from agents.llm.common import require
from agents.llm.retry import Retryable

T = TypeVar("T")

CLOSE_WAIT_S = 5.0  # what a LoopThread's stop gives the requests in flight to end
_CLOSING = "the backend was closed"  # the message of close()'s cancellation of an attempt
_KEEPER = "aio_http lane keeper"  # the name of a task that holds a lane until its loop ends


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as it came: status, headers (looked up in any case) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (None where ``NO_PROXY`` exempts its host)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; on the first failure the others are cancelled (and waited for)
    and the failure is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class LoopThread:
    """An event loop in a daemon thread of its own, for callers without one; the thread starts
    with the first :meth:`run` (a backend that is only awaited never starts it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._started: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
        self._stopped = False

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from any other thread)."""
        with self._lock:
            if self._stopped:
                coro.close()
                raise RuntimeError(f"{self.name}: the loop is stopped")
            if self._started is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._started = loop, thread
            loop = self._started[0]
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def stop(self) -> None:
        """End the loop as ``asyncio.run`` ends one: give its tasks ``CLOSE_WAIT_S`` to finish,
        cancel what is left (which closes its lanes' sessions), then stop and close it.
        Idempotent."""
        with self._lock:
            started, self._started, self._stopped = self._started, None, True
        if started is None:
            return
        loop, thread = started
        try:
            asyncio.run_coroutine_threadsafe(_wind_down(), loop).result(CLOSE_WAIT_S * 3)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CLOSE_WAIT_S)
            if not thread.is_alive():
                loop.close()


async def _wind_down() -> None:
    here = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not here]
    busy = [t for t in others if t.get_name() != _KEEPER]
    if busy:
        await asyncio.wait(busy, timeout=CLOSE_WAIT_S)
    left = [t for t in others if not t.done()]
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=CLOSE_WAIT_S)


@dataclass
class _Lane:
    """What one event loop holds: its session, its width, and what close() must reach."""

    session: Any
    width: asyncio.Semaphore
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    attempts: set[asyncio.Task[Any]] = field(default_factory=set)
    keeper: asyncio.Task[None] | None = None  # held here: the loop keeps only weak references

    def abort(self) -> None:
        """On the lane's loop: end its waits, and its attempts as cancelled."""
        self.closing.set()
        for task in list(self.attempts):
            task.cancel(_CLOSING)


class HttpClient:
    """Requests on the caller's event loop; see the module docstring."""

    def __init__(self, *, url: str, width: int, timeout: float, name: str) -> None:
        self._aiohttp = require("aiohttp", "aiohttp", "openai")
        self.timeout = float(timeout)
        self.width = width
        self.name = name
        self.cancelled = threading.Event()  # set by close(): no request is sent after it
        self._proxy = env_proxy(url)
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._lock = threading.Lock()
        self._own = LoopThread(f"{name} http")  # for callers without a loop

    # -- on the caller's loop ----------------------------------------------------------------
    def _lane(self) -> _Lane:
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:
            aiohttp = self._aiohttp
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.width),
                timeout=aiohttp.ClientTimeout(total=None),  # the deadline is post()'s own
            )
            lane = _Lane(session, asyncio.Semaphore(self.width))
            with self._lock:
                self._lanes[loop] = lane
            lane.keeper = loop.create_task(self._keep(loop, lane), name=_KEEPER)
        return lane

    async def _keep(self, loop: asyncio.AbstractEventLoop, lane: _Lane) -> None:
        """Holds the lane until its loop's run ends (which cancels this), then closes it."""
        try:
            await asyncio.Event().wait()
        finally:
            with self._lock:
                self._lanes.pop(loop, None)
            await lane.session.close()

    def slot(self) -> asyncio.Semaphore:
        """The in-flight limit of the caller's loop (``async with`` it around a request)."""
        return self._lane().width

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """One attempt: POST ``body`` and read the whole answer within ``timeout`` seconds."""
        if self.cancelled.is_set():
            raise Retryable(f"cancelled ({_CLOSING})")
        lane = self._lane()
        task = asyncio.current_task()
        assert task is not None
        lane.attempts.add(task)
        try:
            async with asyncio.timeout(self.timeout):
                post = lane.session.post(url, data=body, headers=headers, proxy=self._proxy)
                async with post as response:
                    data = await response.read()
                    return Answer(response.status, response.headers, data)
        except TimeoutError:
            raise Retryable("timeout") from None
        except (self._aiohttp.ClientError, OSError) as exc:
            raise Retryable(f"connection error ({type(exc).__name__})") from None
        except asyncio.CancelledError as exc:
            if exc.args != (_CLOSING,):
                raise  # the caller's own cancellation
            task.uncancel()
            raise Retryable(f"cancelled ({_CLOSING})") from None
        finally:
            lane.attempts.discard(task)

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the client is closed meanwhile."""
        if self.cancelled.is_set():
            return
        try:
            await asyncio.wait_for(self._lane().closing.wait(), seconds)
        except TimeoutError:
            pass

    # -- for callers without a loop ----------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's own loop and wait for it (from any thread)."""
        return self._own.run(coro)

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """End the attempts in flight and the waits now, on every loop; stop the client's own
        loop (closing its session). Idempotent."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        with self._lock:
            lanes = list(self._lanes.items())
        for loop, lane in lanes:
            if not loop.is_closed():
                loop.call_soon_threadsafe(lane.abort)  # its run's end closes its session
        self._own.stop()
