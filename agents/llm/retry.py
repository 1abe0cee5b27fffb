"""Retries with backoff and jitter for the HTTP backends, and a bounded concurrent map.

The SDKs' own retries are switched off (``max_retries=0``) so that these are the only ones:
each is counted in ``Completion.retries`` and logged. ``Retry-After`` (or ``retry-after-ms``) on
an answer is honoured, capped at ``max_retry_after``; otherwise the wait is exponential with
jitter. A request that still fails raises :class:`~agents.llm.base.BackendError`, whose
``retries`` says how many retries were made.

Each attempt has its own deadline (the backends' ``timeout``, see :mod:`agents.llm.deadline`),
so a request that keeps failing ends within ``(max_retries + 1) * timeout`` plus the waits
between attempts. A request whose backend is closed (``cancelled``) stops at once: its attempt in
flight is aborted, and no wait or retry follows.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from agents.llm.answers import MalformedResponse
from agents.llm.base import BackendError
from agents.llm.common import context_limit_error, opt_float, opt_int

T = TypeVar("T")
R = TypeVar("R")


class Retryable(Exception):
    """A failure worth another try (timeout, 429, 5xx, dropped connection, malformed answer)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try. ``max_retries`` counts retries, not attempts."""

    max_retries: int = 6
    backoff_base: float = 1.0  # first wait, seconds; doubles each retry
    backoff_max: float = 60.0
    jitter: float = 1.0  # up to this many seconds of uniform jitter added to each wait
    max_retry_after: float = 120.0  # never sleep longer than this on a server's Retry-After

    @classmethod
    def from_options(
        cls,
        backend: str,
        *,
        max_retries: Any,
        backoff_base: Any,
        backoff_max: Any,
        jitter: Any,
        max_retry_after: Any,
    ) -> RetryPolicy:
        """A policy from backend options (numbers or strings); a bad value is a SpecError."""

        return cls(
            max_retries=opt_int(backend, "max_retries", max_retries, 0),
            backoff_base=opt_float(backend, "backoff_base", backoff_base, 0.0),
            backoff_max=opt_float(backend, "backoff_max", backoff_max, 0.0),
            jitter=opt_float(backend, "jitter", jitter, 0.0),
            max_retry_after=opt_float(backend, "max_retry_after", max_retry_after, 0.0),
        )

    def describe(self) -> dict[str, float]:
        return {
            "max_retries": self.max_retries,
            "backoff_base": self.backoff_base,
            "backoff_max": self.backoff_max,
            "jitter": self.jitter,
            "max_retry_after": self.max_retry_after,
        }


def classify_sdk_error(sdk: Any, exc: BaseException) -> Retryable | None:
    """Retryable for timeouts, dropped connections, 408/409/429/5xx and malformed JSON.

    ``sdk`` is the ``openai`` or ``anthropic`` module: both SDKs raise the same exception classes
    (``APITimeoutError``, ``APIConnectionError``, ``APIStatusError``).
    """
    if isinstance(exc, sdk.APITimeoutError):
        return Retryable("timeout")
    if isinstance(exc, sdk.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        return Retryable(f"connection error ({type(cause).__name__ if cause else 'closed'})")
    if isinstance(exc, sdk.APIStatusError):
        status = exc.status_code
        if status in (408, 409, 429) or status >= 500:
            headers = dict(exc.response.headers) if exc.response is not None else {}
            return Retryable(f"HTTP {status}", parse_retry_after(headers))
        return None
    return classify_answer_error(exc)


def classify_answer_error(exc: BaseException) -> Retryable | None:
    """Retryable for an answer that is not the answer expected (malformed JSON, missing
    fields), else None."""
    if isinstance(exc, MalformedResponse):
        return Retryable(f"malformed response ({exc})")
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return Retryable(f"malformed response ({type(exc).__name__})")
    return None


def parse_retry_after(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms is not None:
        try:
            return max(float(ms) / 1000.0, 0.0)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


class _Attempts:
    """The retry decisions for one request, shared by :func:`call_with_retries` and
    :func:`acall_with_retries` (which differ only in how they call and wait)."""

    def __init__(
        self,
        classify: Callable[[BaseException], Retryable | None],
        policy: RetryPolicy,
        log: logging.Logger,
        label: str,
        scrub: Callable[[str], str],
        cancelled: threading.Event | None,
        errors: list[str] | None,
    ) -> None:
        self.classify = classify
        self.policy = policy
        self.log = log
        self.label = label
        self.scrub = scrub
        self.cancelled = cancelled or threading.Event()
        self.failed: list[str] = [] if errors is None else errors
        self.made = 0  # attempts begun

    @property
    def retries(self) -> int:
        return max(self.made - 1, 0)

    def begin(self) -> None:
        """Count an attempt; a BackendError instead once the backend is closed."""
        self.made += 1
        if self.cancelled.is_set():
            msg = f"{self.label}: cancelled (the backend was closed)"
            raise BackendError(msg, retries=self.retries, attempt_errors=(*self.failed, msg))

    def failed_with(self, exc: Exception) -> float:
        """The seconds to wait before the next attempt after ``exc``; or the request's final
        error, raised."""
        if isinstance(exc, BackendError):  # the backend's own verdict: not retried
            exc.retries = self.retries
            exc.attempt_errors = (*self.failed, str(exc))
            raise exc
        verdict = exc if isinstance(exc, Retryable) else self.classify(exc)
        if verdict is None:
            raise self._fatal(exc) from None
        reason = self.scrub(verdict.reason)
        self.failed.append(reason)
        if self.cancelled.is_set() or self.made > self.policy.max_retries:
            if self.cancelled.is_set():
                msg = f"{self.label}: cancelled (the backend was closed) after {self.made} attempts"
            else:
                msg = f"{self.label}: gave up after {self.made} attempts: {reason}"
            self.log.error(msg)
            raise BackendError(msg, retries=self.retries, attempt_errors=self.failed) from None
        if verdict.retry_after is not None:
            wait = min(verdict.retry_after, self.policy.max_retry_after)
        else:
            exp = self.policy.backoff_base * 2.0 ** (self.made - 1)
            wait = min(exp, self.policy.backoff_max) + random.uniform(0.0, self.policy.jitter)
        self.log.warning(
            "%s: %s; retry %d/%d in %.2fs",
            self.label,
            reason,
            self.made,
            self.policy.max_retries,
            wait,
        )
        return wait

    def _fatal(self, exc: Exception) -> BackendError:
        """A failure not worth retrying: the prompt's own (too long for the context) or the
        service's."""
        msg = f"{self.label}: {type(exc).__name__}: {self.scrub(str(exc))}"
        limit = context_limit_error(msg, getattr(exc, "code", None), self.label)
        if limit is not None:  # the prompt's own fault: the episode's failure, not the service's
            self.log.warning("%s", limit)
            return limit
        self.log.error(msg)
        self.failed.append(msg)
        return BackendError(msg, retries=self.retries, attempt_errors=self.failed)


def call_with_retries(
    call: Callable[[], T],
    classify: Callable[[BaseException], Retryable | None],
    policy: RetryPolicy,
    *,
    log: logging.Logger,
    label: str,
    scrub: Callable[[str], str] = lambda s: s,
    cancelled: threading.Event | None = None,
    errors: list[str] | None = None,
) -> tuple[T, int]:
    """Run ``call`` until it succeeds; returns ``(result, retries)``. ``errors``, when given,
    gets why each failed attempt failed (scrubbed), in order; a BackendError raised carries
    them too (``attempt_errors``).

    ``classify`` turns an exception into :class:`Retryable` or None (not worth retrying: raised
    at once as BackendError). ``scrub`` cleans messages of secrets before they are logged/raised.
    Once ``cancelled`` is set (the backend is closing) there is no further attempt and no wait:
    the request fails with a BackendError that says so. Every BackendError raised carries the
    retries made.
    """
    attempts = _Attempts(classify, policy, log, label, scrub, cancelled, errors)
    while True:
        attempts.begin()
        try:
            return call(), attempts.retries
        except Exception as exc:
            wait = attempts.failed_with(exc)
        attempts.cancelled.wait(wait)  # a wait ends when the backend is closed


async def acall_with_retries(
    call: Callable[[], Awaitable[T]],
    classify: Callable[[BaseException], Retryable | None],
    policy: RetryPolicy,
    *,
    log: logging.Logger,
    label: str,
    sleep: Callable[[float], Awaitable[None]],
    scrub: Callable[[str], str] = lambda s: s,
    cancelled: threading.Event | None = None,
    errors: list[str] | None = None,
) -> tuple[T, int]:
    """:func:`call_with_retries` for a coroutine: the same attempts, waits and errors;
    ``sleep`` waits between attempts (and should end early once ``cancelled`` is set)."""
    attempts = _Attempts(classify, policy, log, label, scrub, cancelled, errors)
    while True:
        attempts.begin()
        try:
            return await call(), attempts.retries
        except Exception as exc:
            wait = attempts.failed_with(exc)
        await sleep(wait)


def concurrent_map(fn: Callable[[T], R], items: Sequence[T], pool: ThreadPoolExecutor) -> list[R]:
    """``[fn(x) for x in items]`` run on ``pool``, in input order.

    On the first error the items not yet started are cancelled, the running ones are waited
    for (so no request is left running unobserved), and the error is raised.
    """
    futures = [pool.submit(fn, x) for x in items]
    results: list[Any] = []
    first_error: BaseException | None = None
    for f in futures:
        if first_error is not None:
            f.cancel()
            continue
        try:
            results.append(f.result())
        except BaseException as exc:  # noqa: B036 - re-raised below
            first_error = exc
            for g in futures:
                g.cancel()
    if first_error is not None:
        for f in futures:
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:  # noqa: B036, S110 - the first error wins
                    pass
        raise first_error
    return results
