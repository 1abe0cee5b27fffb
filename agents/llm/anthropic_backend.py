"""Anthropic's Messages API (``anthropic:<model>``), through the official SDK.

Completion-style prompts become chat as ``chat_format`` says (default ``"user"``: the prompt as
one user message after :data:`~agents.llm.common.CONTINUE_INSTRUCTION`; ``"prefill"`` sends the
prompt as an unfinished assistant turn, for models that still accept prefill, with trailing
whitespace removed as the API requires). System messages go to the ``system`` parameter.

Sampling: the current API version (the one SDK 2.x sends) rejects ``temperature``, ``top_p`` and
``top_k`` on every model, and has no ``seed``. So by default (``sampling="omit"``) they are not
sent and the model's own sampling applies; this is stated in ``describe()`` and in every
``Completion.sent``, and logged once. ``sampling="send"`` puts temperature and top_p in the
request body, for older API versions or compatible proxies that accept them.

Stop strings: the API rejects whitespace-only stop sequences (such as ReAct's ``"\\n"``), so those
are applied here to the returned text instead; the others are sent. Only ``text`` content
blocks are read (thinking blocks are skipped). ``n > 1`` is served by ``n`` requests.

Concurrency, retries (timeouts, 429 with Retry-After, 5xx and 529 overloaded, dropped
connections, malformed JSON), ``timeout`` (the deadline of one whole attempt, each retry with its
own), ``close()`` (ends the requests in flight), oversized answers and key handling are those of
the OpenAI backend: the key is read from ``api_key_env`` (default ``ANTHROPIC_API_KEY``) only
and never stored or logged.
Grounded decoding: the Messages API cannot restrict the answer to a list of commands, so a
request with a ``constraint`` is a one-line :class:`SpecError` naming ``--action-decoding
nearest`` (free output mapped to the nearest admissible command afterwards).
Usage: ``prompt_tokens`` = input + cache-read + cache-write tokens; ``cached_tokens`` = cache
reads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agents.llm.answers import MalformedResponse, count, json_object
from agents.llm.base import BackendError, Completion, Request, SpecError
from agents.llm.common import (
    CONTINUE_INSTRUCTION,
    check_chat_format,
    finish_texts,
    grounding_error,
    key_scrubber,
    messages_as_dicts,
    opt_float,
    opt_int,
    prompt_as_messages,
    require,
    safe_url,
    url_secrets,
)
from agents.llm.deadline import RequestGuard
from agents.llm.redaction import redact
from agents.llm.retry import (
    Retryable,
    RetryPolicy,
    call_with_retries,
    classify_sdk_error,
    concurrent_map,
)

log = logging.getLogger("agents.llm.anthropic")

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


def classify_anthropic_error(exc: BaseException) -> Retryable | None:
    """Retryable for timeouts, dropped connections, 408/409/429/5xx and malformed JSON."""
    import anthropic  # heavy: anthropic is an optional extra

    return classify_sdk_error(anthropic, exc)


class AnthropicBackend:
    """A Claude model over HTTP. See the module docstring for the options."""

    # the engine sends each request on its own as it comes, at most its concurrency at once
    scheduling = "per_request"
    grounding: str | None = None  # no constrained decoding in the Messages API
    grounding_missing = "the Messages API cannot restrict an answer to a list of commands"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        chat_format: str = "user",
        chat_instruction: str = CONTINUE_INSTRUCTION,
        sampling: str = "omit",
        thinking: Mapping[str, Any] | None = None,
        concurrency: int | str = 8,
        timeout: float | str = 60.0,
        max_retries: int | str = 6,
        backoff_base: float | str = 1.0,
        backoff_max: float | str = 60.0,
        jitter: float | str = 1.0,
        max_retry_after: float | str = 120.0,
        api_key_env: str = "ANTHROPIC_API_KEY",
        extra_body: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        who = "anthropic"
        if not model:
            raise SpecError("anthropic needs a model: use anthropic:<model name>")
        if sampling not in ("omit", "send"):
            raise SpecError(f"{who}: sampling={sampling!r} must be omit or send")
        self.model = model
        # the SDK would read ANTHROPIC_BASE_URL itself; resolve it here so describe() tells the truth
        base_url = base_url or os.environ.get("ANTHROPIC_BASE_URL") or None
        self.base_url = base_url
        self.chat_format = check_chat_format(chat_format, allow_raw=False, backend=who)
        self.chat_instruction = chat_instruction
        self.sampling = sampling
        self.thinking = dict(thinking) if thinking else None
        self.concurrency = opt_int(who, "concurrency", concurrency, 1)
        self.timeout = opt_float(who, "timeout", timeout, 0.001)
        self.policy = RetryPolicy.from_options(
            who,
            max_retries=max_retries,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            jitter=jitter,
            max_retry_after=max_retry_after,
        )
        self.extra_body = dict(extra_body or {})
        self.name = name or f"anthropic:{model}"
        self.api_key_env = api_key_env
        key = os.environ.get(api_key_env)
        if not key:
            raise SpecError(f"{self.name}: set the {api_key_env} environment variable")
        # the key lives only in this closure and the SDK client (and the URL's secrets)
        self._scrub = key_scrubber(key, *url_secrets(base_url))
        anthropic = require("anthropic", "anthropic", "anthropic")

        self._guard = RequestGuard(self.timeout)  # timeout: the whole of each attempt
        self._client = anthropic.Anthropic(
            api_key=key,
            base_url=base_url,
            max_retries=0,
            timeout=self.timeout,
            http_client=self._guard.http_client(anthropic),
        )
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="anthropic")
        self._warned = False

    def __repr__(self) -> str:
        return f"AnthropicBackend(name={self.name!r}, base_url={safe_url(self.base_url)!r})"

    def describe(self) -> dict[str, Any]:
        return {
            "spec": self.name,
            "backend": "anthropic",
            "model": self.model,
            "base_url": safe_url(self.base_url),
            "chat_format": self.chat_format,
            "chat_instruction": self.chat_instruction,
            "sampling": (
                "omitted: the model's own sampling applies (temperature/top_p/seed not sent)"
                if self.sampling == "omit"
                else "temperature and top_p sent in the request body"
            ),
            "thinking": self.thinking,
            "concurrency": self.concurrency,
            "timeout": self.timeout,
            "retry": self.policy.describe(),
            "api_key_env": self.api_key_env,
            "extra_body": self.extra_body,
        }

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if any(r.constraint is not None for r in requests):
            raise grounding_error(self.name, self.grounding_missing)
        if self.sampling == "omit" and not self._warned and requests:
            self._warned = True
            log.warning(
                "%s: temperature/top_p/seed are not sent (the Messages API rejects them); "
                "the model's own sampling applies",
                self.name,
            )
        indexed = list(enumerate(requests))
        return concurrent_map(lambda item: self._one(*item), indexed, self._pool)

    def _payload(self, request: Request) -> tuple[dict[str, Any], list[str]]:
        c = request.config
        if request.messages is not None:
            messages = messages_as_dicts(request.messages)
        else:
            assert request.prompt is not None
            messages = prompt_as_messages(request.prompt, self.chat_format, self.chat_instruction)
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        messages = [m for m in messages if m["role"] != "system"]
        if messages and messages[-1]["role"] == "assistant":
            messages[-1] = {"role": "assistant", "content": messages[-1]["content"].rstrip()}
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": c.max_tokens,
            "messages": messages,
        }
        if system:
            params["system"] = system
        sent_stops = [s for s in c.stop if s.strip()]
        local_stops = [s for s in c.stop if not s.strip()]
        if sent_stops:
            params["stop_sequences"] = sent_stops
        if self.thinking:
            params["thinking"] = self.thinking
        extra = dict(self.extra_body)
        if self.sampling == "send":
            extra.setdefault("temperature", c.temperature)
            if c.top_p < 1.0:
                extra.setdefault("top_p", c.top_p)
        if extra:
            params["extra_body"] = extra
        return params, local_stops

    def _one(self, index: int, request: Request) -> Completion:
        params, local_stops = self._payload(request)

        def call() -> tuple[str, str, tuple[int, int, int]]:
            # the answer's JSON as sent, checked by _parse
            return _parse(
                self._client.messages.with_raw_response.create(**params).http_response.json()
            )

        start = time.perf_counter()
        label = f"{self.name} request {index}"
        results = []
        retries = 0
        errors: list[str] = []
        for _ in range(request.config.n):
            try:
                result, r = call_with_retries(
                    call,
                    classify_anthropic_error,
                    self.policy,
                    log=log,
                    label=label,
                    scrub=self._scrub,
                    cancelled=self._guard.cancelled,
                    errors=errors,
                )
            except BackendError as exc:
                exc.retries += retries  # those of the answers before it too
                raise
            results.append(result)
            retries += r
        latency = time.perf_counter() - start
        texts, finish = finish_texts(
            [(text, finish) for text, finish, _ in results], request.config, log=log, label=label
        )
        usage = [sum(u[i] for _, _, u in results) for i in range(3)]
        sent = {k: v for k, v in params.items() if k != "extra_body"}
        if "extra_body" in params:  # the user's part may hold a key: recorded without it
            extra = params["extra_body"]
            sent["extra_body"] = redact(extra) if self.extra_body else extra
        sent["stop_applied_locally"] = local_stops
        if self.sampling == "omit":
            sent["sampling"] = "model default"
        return Completion(
            text=texts[0],
            finish_reason=finish,
            prompt_tokens=usage[0],
            completion_tokens=usage[1],
            cached_tokens=usage[2],
            latency_s=latency,
            retries=retries,
            sent=sent,
            alternatives=tuple(texts[1:]),
            attempt_errors=tuple(errors),
        )

    def close(self) -> None:
        """End the requests in flight at once (they fail with a BackendError that says the
        backend was closed) and release the connections; waits for nothing."""
        self._guard.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _parse(answer: Any) -> tuple[str, str, tuple[int, int, int]]:
    """Text, finish reason and (prompt, completion, cached) tokens of a 200 answer's JSON;
    MalformedResponse if it lacks them or its counts are no counts (:mod:`agents.llm.answers`)."""
    blocks = json_object(answer, "the answer").get("content")
    if not isinstance(blocks, list):
        raise MalformedResponse("no content")
    text = "".join(
        b["text"]
        for b in (json_object(b, "a content block") for b in blocks)
        if b.get("type") == "text" and isinstance(b.get("text"), str)
    )
    stop = answer.get("stop_reason")
    finish = _FINISH.get(str(stop), str(stop or "stop"))
    usage = json_object(answer.get("usage"), "usage")
    fresh, read, write, out = (
        count(usage.get(key), f"usage.{key}")
        for key in (
            "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
            "output_tokens",
        )
    )  # fmt: skip
    return text, finish, (fresh + read + write, out, read)
