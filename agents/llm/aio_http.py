"""JSON over keep-alive HTTP on an event loop of the backend's own, for the OpenAI-compatible
backend: no thread per request and no SDK on a request's path.

:class:`HttpLoop` runs one event loop in a thread of its own with one ``aiohttp`` session on it.
A request is a coroutine on that loop, handed over from any thread (:meth:`HttpLoop.run`, which
blocks) or any event loop (:meth:`HttpLoop.submit` and ``asyncio.wrap_future``, which does
not): the engine's loop awaits its requests without a thread each, and every request shares the
session's pooled connections. The proxy comes from the environment (``HTTPS_PROXY``,
``HTTP_PROXY``, ``NO_PROXY``), read once for the server's URL (aiohttp's ``trust_env`` would
read it, and ``~/.netrc``, in a thread for every request).

Each attempt (:meth:`HttpLoop.post`) has one deadline for all of it, ``timeout`` seconds:
waiting for a pooled connection, connecting, sending and reading the whole answer, so a server
that trickles its answer or never ends it cannot hold a request longer. A transport failure is
a :class:`~agents.llm.retry.Retryable` (``timeout``, ``connection error (...)``); an answer,
whatever its status, is returned as it came for the caller to judge.

:meth:`HttpLoop.close` ends the requests in flight at once (their connections are shut; they
fail as cancelled), ends the waits between retries (:meth:`HttpLoop.sleep`) and fails every
later request before it is sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import urllib.request
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from agents.llm.common import require
from agents.llm.retry import Retryable

T = TypeVar("T")

CLOSE_WAIT_S = 5.0  # what close() gives the requests in flight to end
_CLOSING = "the backend was closed"  # the message of close()'s cancellation of an attempt


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as it came: status, headers (names in lower case) and body."""

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


class HttpLoop:
    """One event loop thread and one HTTP session; see the module docstring."""

    def __init__(self, *, url: str, width: int, timeout: float, name: str) -> None:
        self._aiohttp = require("aiohttp", "aiohttp", "openai")
        self.timeout = float(timeout)
        self._proxy = env_proxy(url)
        self.cancelled = threading.Event()  # set by close(): no request is sent after it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{name} http", daemon=True
        )
        self._thread.start()
        self._session, self.width, self._closing = self.run(self._open(width))
        self._closed = False
        self._lock = threading.Lock()
        self._attempts: set[asyncio.Task[Any]] = set()  # the tasks with an attempt in flight

    async def _open(self, width: int) -> tuple[Any, asyncio.Semaphore, asyncio.Event]:
        aiohttp = self._aiohttp
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=width),
            timeout=aiohttp.ClientTimeout(total=None),  # the deadline is post()'s own
        )
        return session, asyncio.Semaphore(width), asyncio.Event()

    # -- handing coroutines to the loop ------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from any thread but the loop's own)."""
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future (``asyncio.wrap_future`` awaits it from another
        loop, and cancelling that cancels the coroutine)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- on the loop -------------------------------------------------------------------------
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """One attempt: POST ``body`` and read the whole answer within ``timeout`` seconds."""
        if self.cancelled.is_set():
            raise Retryable(f"cancelled ({_CLOSING})")
        task = asyncio.current_task()
        assert task is not None
        self._attempts.add(task)
        try:
            async with asyncio.timeout(self.timeout):
                post = self._session.post(url, data=body, headers=headers, proxy=self._proxy)
                async with post as response:
                    data = await response.read()
                    return Answer(
                        response.status,
                        {k.lower(): v for k, v in response.headers.items()},
                        data,
                    )
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
            self._attempts.discard(task)

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the loop is closed meanwhile."""
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except TimeoutError:
            pass

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """End the requests in flight and the waits now, close the connections, stop the loop.
        Idempotent; waits at most ``CLOSE_WAIT_S`` for the requests in flight to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.cancelled.set()
        try:
            self.run(self._shut())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_WAIT_S)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shut(self) -> None:
        self._closing.set()
        for task in list(self._attempts):  # each ends its attempt as cancelled, at once
            task.cancel(_CLOSING)
        await self._session.close()
        here = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not here]
        if others:
            _, late = await asyncio.wait(others, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
