"""A whole-request deadline, and cancellation, for an SDK's httpx client (Anthropic's backend;
the OpenAI-compatible one has its own client, :mod:`agents.llm.aio_http`).

httpx's timeouts (the ``timeout=`` of the openai and anthropic SDKs) bound each socket
operation on its own: the read timeout is per chunk, so a server that trickles a body, or sends
an endless chunked one, holds a request for ever. :class:`RequestGuard` gives each request one
deadline for all of it: waiting for a pooled connection, connect, TLS, sending, and reading the
whole body. Every socket operation of a request gets at most the time left before that deadline
and fails with a timeout once it has passed, so an attempt ends within ``timeout`` seconds
whatever the server does (the SDK raises its ``APITimeoutError``, which the retries in
:mod:`agents.llm.retry` count like any timeout).

:meth:`RequestGuard.cancel` ends requests on demand: it shuts down every open connection of the
client, so a request blocked in a read ends at once, and every later request fails before it is
sent. The backends call it from ``close()``, so an interrupted run does not wait on a request
thread. (A connect in progress cannot be shut down; it still ends by its deadline.)

How: the guard sits beneath httpx, as the network backend of the client's connection pools, and
keeps the deadline of the request a thread is sending in a thread-local (a sync httpx client
sends a request, body included, on the thread that called it; a ``request`` event hook starts
the deadline). httpx exposes no network backend option, so the guard is set on the pools of the
client's transports (``_pool._network_backend``, checked here, and by the tests against a real
server).
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
import weakref
from typing import Any


class RequestGuard:
    """Deadlines of ``timeout`` seconds per request, and cancellation, for one SDK client."""

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.cancelled = threading.Event()
        self._local = threading.local()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._core: Any = None  # the httpcore module of the client (for its exception types)

    def http_client(self, sdk: Any) -> Any:
        """The SDK's default httpx client (``sdk.DefaultHttpxClient``: its limits, redirects and
        proxies) with this guard on every request; pass it as the SDK client's ``http_client``."""
        httpx, self._core = _http_modules(sdk)
        limits = getattr(sdk, "DEFAULT_CONNECTION_LIMITS", None)
        transport = httpx.HTTPTransport(**({"limits": limits} if limits is not None else {}))
        client = sdk.DefaultHttpxClient(transport=transport, event_hooks={"request": [self._begin]})
        # proxies from the environment are mounted transports of their own
        for t in [transport, *getattr(client, "_mounts", {}).values()]:
            pool = getattr(t, "_pool", None)
            if pool is None:
                continue
            if not hasattr(pool, "_network_backend"):
                raise RuntimeError(
                    f"{type(pool).__module__}.{type(pool).__name__} has no network backend to "
                    "guard: this httpx version is not supported by agents.llm.deadline"
                )
            pool._network_backend = _Network(pool._network_backend, self)
        return client

    def cancel(self) -> None:
        """End every request in flight now, and fail every later one before it is sent."""
        self.cancelled.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.abort()

    # -- the deadline of the request this thread is sending -------------------------------------
    def _begin(self, request: Any) -> None:
        self._local.deadline = time.monotonic() + self.timeout

    def _left(self, timeout: float | None, op: str) -> float | None:
        """The timeout for one socket operation: at most the time left to this thread's request
        (``op`` names the timeout raised when none is left: connect, read or write)."""
        core = self._core
        if self.cancelled.is_set():
            raise core.ReadError("cancelled: the backend was closed")
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline - time.monotonic()
        if left <= 0:
            kind = {"connect": core.ConnectTimeout, "write": core.WriteTimeout}
            raise kind.get(op, core.ReadTimeout)(
                f"the whole-request deadline of {self.timeout:g}s passed"
            )
        return left if timeout is None else min(timeout, left)

    def _track(self, stream: _Stream) -> _Stream:
        with self._lock:
            self._streams.add(stream)
        if self.cancelled.is_set():  # cancelled while it was connecting
            stream.abort()
        return stream

    def _forget(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)


def _http_modules(sdk: Any) -> tuple[Any, Any]:
    """The (httpx, httpcore) pair the SDK's client is built on: httpx2 for the current SDKs,
    httpx for older ones."""
    for client_name, core_name in (("httpx2", "httpcore2"), ("httpx", "httpcore")):
        try:
            httpx = importlib.import_module(client_name)
            core = importlib.import_module(core_name)
        except ImportError:
            continue
        if issubclass(sdk.DefaultHttpxClient, httpx.Client):
            return httpx, core
    raise RuntimeError(f"{sdk.__name__}'s http client is neither httpx2 nor httpx")


class _Network:
    """An httpcore network backend whose streams keep to their request's deadline."""

    def __init__(self, inner: Any, guard: RequestGuard) -> None:
        self._inner = inner
        self._guard = guard

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> _Stream:
        left = self._guard._left(timeout, "connect")
        inner = self._inner.connect_tcp(host, port, left, local_address, socket_options)
        return self._guard._track(_Stream(inner, self._guard))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> _Stream:
        left = self._guard._left(timeout, "connect")
        inner = self._inner.connect_unix_socket(path, left, socket_options)
        return self._guard._track(_Stream(inner, self._guard))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _Stream:
    """An httpcore network stream whose reads and writes end by the request's deadline."""

    def __init__(self, inner: Any, guard: RequestGuard) -> None:
        self._inner = inner
        self._guard = guard

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = self._inner.read(max_bytes, self._guard._left(timeout, "read"))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._guard._left(timeout, "write"))

    def close(self) -> None:
        self._guard._forget(self)
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> _Stream:
        left = self._guard._left(timeout, "connect")
        self._inner = self._inner.start_tls(ssl_context, server_hostname, left)
        return self

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    def abort(self) -> None:
        """Shut the connection down: a read or write blocked on it (in any thread) ends now.
        The socket itself is left for its owner to close."""
        sock = self._inner.get_extra_info("socket")
        if sock is None:
            return
        try:
            # the plain socket's shutdown, also for a TLS socket (whose own shutdown would
            # drop its TLS state under a thread that is reading it)
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass  # already closed
