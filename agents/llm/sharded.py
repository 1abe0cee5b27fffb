"""One run's games shared by several OpenAI-compatible servers (``--base-url URL1,URL2,...``).

``ShardedBackend`` holds one :class:`~agents.llm.openai_backend.OpenAIBackend` per server and
routes every request by a stable hash of its call site's game, ``Request.site.game``
(rendezvous hashing: each server's score is ``sha256(url + game)``, the highest wins), so all
steps and the reflections of an episode go to the same server, whose prefix cache then holds
that episode's prompt. The mapping depends only on the game ids and the set of URLs (not their
order, not the process), so a resumed run sends each game where it went before. Requests without a game are routed by their
prompt text.

Each server's share of a batch is sent concurrently with the others' (and within a share, up to
that server's ``concurrency`` at a time). The engine awaits each request from its event loop
(``agenerate``, no thread: the servers' clients send from that loop); ``generate`` runs the same
code on a loop of the backend's own. A request's first attempt on a server is made without
retries; when it fails, the server is probed (``GET <url>/models``). If the server does not
answer, it is marked down for ``down_for_s`` seconds and the request, and every later one routed
there, goes to the game's next server in rendezvous order (the same one for all of that game's
steps, so its cache warms up again): a dead server is left after one failed attempt, not after
minutes of backoff. If it answers, the request is retried on that server with the usual policy
(``max_retries``, backoff, Retry-After, as the OpenAI backend does), and an error that persists
is the request's own: raised as it is, never failed over. A failover is logged on
``agents.llm.sharded``, counted in :meth:`ShardedBackend.stats`, added to the completion's
``retries`` (so the run store records it as a retry) and noted in ``Completion.sent``
(``server``, ``failed_over_from``). When no server is left,
:class:`~agents.llm.base.BackendError` is raised and the runner records the episodes as errored
(``--resume`` plays them again). Every other option is passed to each server's OpenAIBackend,
``grammar_dialect`` included: a request's ``constraint`` goes to its server unchanged, and the
server enforces it (a ``vllm:`` spec defaults to vLLM's structured outputs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from agents.llm.aio_http import LoopThread, gather_or_cancel
from agents.llm.base import BackendError, Completion, ContextLimitError, Request, SpecError
from agents.llm.common import routing_key, safe_url
from agents.llm.openai_backend import OpenAIBackend

log = logging.getLogger("agents.llm.sharded")

PROBE_TIMEOUT_S = 3.0


class _RequestError(BackendError):
    """A request that failed on a server that answers: raised as is, never failed over."""


def ranking(key: str, urls: Sequence[str]) -> list[int]:
    """Server indices in preference order for ``key`` (rendezvous hashing; stable, order-free)."""

    def score(i: int) -> bytes:
        return hashlib.sha256(f"{urls[i]}\n{key}".encode()).digest()

    return sorted(range(len(urls)), key=score, reverse=True)


def _server_options() -> set[str]:
    params = inspect.signature(OpenAIBackend).parameters
    return {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - {
        "base_url",
        "name",
    }


class ShardedBackend:
    """Several OpenAI-compatible servers behind one backend; see the module docstring."""

    def __init__(
        self,
        model: str,
        base_urls: Sequence[str],
        *,
        name: str | None = None,
        down_for_s: float | str = 30.0,
        **server_options: Any,
    ) -> None:
        urls = [u.strip().rstrip("/") for u in base_urls if u and u.strip()]
        if len(urls) < 2:
            raise SpecError(
                f"a sharded backend needs at least two base URLs separated by commas, got {base_urls!r}"
            )
        if len(set(urls)) != len(urls):
            raise SpecError(f"base URL listed twice in {','.join(urls)!r}: list each server once")
        unknown = sorted(set(server_options) - _server_options())
        if unknown:
            raise SpecError(
                f"unknown option(s) {', '.join(unknown)} for a sharded backend; valid: "
                f"{', '.join(sorted(_server_options() | {'down_for_s'}))}"
            )
        try:
            self.down_for_s = float(down_for_s)
        except (TypeError, ValueError):
            raise SpecError(f"sharded: option down_for_s={down_for_s!r} must be a number") from None

        self.model = model
        self.urls = urls
        self.name = name or f"openai:{model}"
        self._closing = threading.Event()
        # per server: a first attempt without retries, and the patient retries once it answers
        self.servers: list[OpenAIBackend] = []
        self._patient: list[OpenAIBackend] = []
        once = {**server_options, "max_retries": 0}
        try:
            for url in urls:
                label = f"{self.name}@{safe_url(url)}"
                self.servers.append(OpenAIBackend(model, base_url=url, name=label, **once))
                self._patient.append(
                    OpenAIBackend(model, base_url=url, name=label, **server_options)
                )
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._down_until: dict[int, float] = {}
        self._requests = [0] * len(urls)
        self._failed_over = [0] * len(urls)  # requests that left this server because it was down
        self._outages = [0] * len(urls)
        self._own = LoopThread(f"{self.name} sharded")  # generate's loop

    def describe(self) -> dict[str, Any]:
        """The servers and the routing rule; safe to store (no key)."""
        return {
            "spec": self.name,
            "backend": "sharded",
            "model": self.model,
            "routing": "rendezvous sha256(url, site.game)",
            "down_for_s": self.down_for_s,
            "servers": [s.describe() for s in self._patient],
        }

    @property
    def grounding(self) -> str | None:
        """How the servers enforce an ActionConstraint (they share every option)."""
        return self._patient[0].grounding

    @property
    def grounding_missing(self) -> str:
        return self._patient[0].grounding_missing

    def stats(self) -> dict[str, Any]:
        """Requests answered per server, failovers away from each, and outages seen."""
        with self._lock:
            return {
                "requests": dict(zip(self.urls, self._requests, strict=True)),
                "failed_over": dict(zip(self.urls, self._failed_over, strict=True)),
                "outages": dict(zip(self.urls, self._outages, strict=True)),
                "down": [self.urls[i] for i in self._down_now()],
            }

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """The requests' answers, sent concurrently; the first failure is raised."""
        return self._own.run(gather_or_cancel([self._one(r) for r in requests]))

    async def agenerate(self, request: Request) -> Completion:
        """One request, sent from the caller's event loop (no thread)."""
        return await self._one(request)

    async def _one(self, request: Request) -> Completion:
        ranked = ranking(routing_key(request), self.urls)
        preferred = ranked[0]
        with self._lock:
            down = set(self._down_now())
        # servers marked down go last: tried only when every other server has failed too
        order = [i for i in ranked if i not in down] + [i for i in ranked if i in down]
        failures = 0
        last_error: BackendError | None = None
        for i in order:
            try:
                completion = await self._send(i, request)
            except (_RequestError, ContextLimitError) as exc:  # the request's own: no failover
                exc.retries += failures
                raise
            except BackendError as exc:
                if self._closing.is_set():  # cancelled: no probe, no failover
                    exc.retries += failures
                    raise
                last_error = exc
                failures += 1
                self._mark_down(i, exc)
                continue
            with self._lock:
                self._requests[i] += 1
                self._down_until.pop(i, None)
                if i != preferred:
                    self._failed_over[preferred] += 1
            return self._noted(completion, i, preferred, failures)
        raise BackendError(
            f"{self.name}: all {len(self.urls)} servers are down "
            f"({', '.join(str(safe_url(u)) for u in self.urls)}); last error: {last_error}",
            retries=failures - 1,  # one attempt on each server
        )

    async def _send(self, i: int, request: Request) -> Completion:
        """One request to server ``i``; BackendError only when the server does not answer."""
        try:
            return await self.servers[i].agenerate(request)
        except ContextLimitError:
            raise
        except BackendError:
            if self._closing.is_set() or not await asyncio.to_thread(self._answers, i):
                raise
        # it answers: retry there as a single server would; an error now is the request's own
        try:
            c = await self._patient[i].agenerate(request)
        except BackendError as exc:
            raise _RequestError(str(exc), retries=exc.retries + 1) from None
        return dataclasses.replace(c, retries=c.retries + 1)

    def _noted(self, c: Completion, i: int, preferred: int, failures: int) -> Completion:
        sent = dict(c.sent) if isinstance(c.sent, dict) else {"sent": c.sent}
        sent["server"] = safe_url(self.urls[i])
        if i != preferred:
            sent["failed_over_from"] = safe_url(self.urls[preferred])
        return dataclasses.replace(c, sent=sent, retries=c.retries + failures)

    def _down_now(self) -> list[int]:
        now = time.monotonic()
        return [i for i, until in self._down_until.items() if until > now]

    def _mark_down(self, i: int, exc: BaseException) -> None:
        with self._lock:
            was_down = self._down_until.get(i, 0.0) > time.monotonic()
            self._down_until[i] = time.monotonic() + self.down_for_s
            if not was_down:
                self._outages[i] += 1
        if not was_down:
            log.warning(
                "%s: server %s is down (%s); its games go to their next server for %.0fs",
                self.name,
                safe_url(self.urls[i]),
                exc,
                self.down_for_s,
            )

    def _answers(self, i: int) -> bool:
        """Whether server ``i`` answers ``GET /models`` now (up, so an error is the request's)."""
        try:
            with urllib.request.urlopen(
                f"{self.urls[i]}/models", timeout=PROBE_TIMEOUT_S
            ) as response:
                return bool(200 <= response.status < 500)
        except urllib.error.HTTPError as exc:
            return exc.code < 500  # e.g. 401 without a key: it is up
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """End the requests in flight at once (each server's own close) and wait for nothing."""
        self._closing.set()
        for s in (*self.servers, *getattr(self, "_patient", ())):
            s.close()
        own = getattr(self, "_own", None)  # absent when a server's options were refused
        if own is not None:
            own.stop()
