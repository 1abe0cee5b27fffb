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
from collections.abc import Callable, Mapping, Sequence
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
    import tenacity  # lazily: tenacity costs ~30 ms; only a backend that calls out retries

    stop_event = cancelled or threading.Event()
    failed: list[str] = [] if errors is None else errors

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, Retryable) and exc.retry_after is not None:
            return min(exc.retry_after, policy.max_retry_after)
        exp = policy.backoff_base * 2.0 ** (state.attempt_number - 1)
        return min(exp, policy.backoff_max) + random.uniform(0.0, policy.jitter)

    def attempt() -> T:
        if stop_event.is_set():
            raise BackendError(f"{label}: cancelled (the backend was closed)")
        try:
            return call()
        except Retryable:
            raise
        except Exception as exc:
            verdict = classify(exc)
            if verdict is None:
                raise
            raise verdict from exc

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        reason = exc.reason if isinstance(exc, Retryable) else repr(exc)
        sleep = state.next_action.sleep if state.next_action else 0.0
        failed.append(scrub(reason))
        log.warning(
            "%s: %s; retry %d/%d in %.2fs",
            label,
            scrub(reason),
            state.attempt_number,
            policy.max_retries,
            sleep,
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_retries + 1)
        | tenacity.stop_when_event_set(stop_event),
        wait=wait,
        sleep=tenacity.nap.sleep_using_event(stop_event),  # a wait ends when it is set
        retry=tenacity.retry_if_exception_type(Retryable),
        before_sleep=before_sleep,
        reraise=True,
    )
    attempts = 0
    try:
        for try_ in retrying:
            with try_:
                attempts = try_.retry_state.attempt_number
                result = attempt()
        return result, attempts - 1
    except Retryable as exc:
        if stop_event.is_set():
            msg = f"{label}: cancelled (the backend was closed) after {attempts} attempts"
        else:
            msg = f"{label}: gave up after {attempts} attempts: {scrub(exc.reason)}"
        log.error(msg)
        failed.append(scrub(exc.reason))
        raise BackendError(msg, retries=attempts - 1, attempt_errors=failed) from None
    except BackendError as exc:
        exc.retries = max(attempts - 1, 0)
        exc.attempt_errors = (*failed, str(exc))
        raise
    except Exception as exc:
        msg = f"{label}: {type(exc).__name__}: {scrub(str(exc))}"
        limit = context_limit_error(msg, getattr(exc, "code", None), label)
        if limit is not None:  # the prompt's own fault: the episode's failure, not the service's
            log.warning("%s", limit)
            raise limit from None
        log.error(msg)
        failed.append(msg)
        raise BackendError(msg, retries=max(attempts - 1, 0), attempt_errors=failed) from None


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
