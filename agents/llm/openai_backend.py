"""OpenAI and OpenAI-compatible servers (vLLM's ``vllm serve``, llama.cpp's server, ...).

``openai:<model>`` talks to api.openai.com; with ``base_url=`` to any compatible server.

Endpoints: chat-message requests always use ``/chat/completions``. Completion-style ``prompt``
requests use ``/completions`` when ``api="completions"`` and ``/chat/completions`` when
``api="chat"``; there the prompt is wrapped as ``chat_format`` says (``"user"``, see
:mod:`agents.llm.common`; ``"prefill"`` adds vLLM's ``continue_final_message`` and
``add_generation_prompt=false``). ``api="auto"`` (the default) follows ``chat_format``:
``"user"`` or ``"prefill"`` is the chat endpoint, ``"raw"`` the completions endpoint (the prompt
sent exactly); without one, the completions endpoint when ``base_url`` is given (vLLM and
llama.cpp serve it) and the chat endpoint with ``"user"`` for api.openai.com (whose current
models are chat-only). A ``chat_format`` that contradicts ``api`` is a :class:`SpecError`, and
so is a ``base_url`` server that answers a wrapped prompt with ``404`` (it has no chat endpoint):
the prompt is never sent elsewhere than where the run's config says. ``describe()`` records the
endpoint (``api``) and the ``chat_format`` of what was sent (``"raw"`` for completions).

Requests go out from the event loop that awaits them (:mod:`agents.llm.aio_http`: an
``aiohttp`` session per loop, keep-alive connections, no SDK and no thread per request):
``agenerate`` sends one from the caller's loop (the engine's way), ``generate`` sends a
batch concurrently on a loop of the backend's own and waits; at most ``concurrency`` (default
8) are in flight at once on a loop. :mod:`agents.llm.retry` retries timeouts, 429 (honouring
Retry-After), 408, 409, 5xx, dropped connections and malformed JSON, counts them in
``Completion.retries`` (and in a failed request's ``BackendError.retries``) and logs them on
``agents.llm.openai``; any other status fails the request at once (``HTTPError``, naming the
status and the server's message).

``timeout`` (seconds, default 60) is the deadline of one whole attempt: waiting for a
connection, connecting, sending and reading the entire answer, so a server that trickles its
answer or never ends it cannot hold a request longer. Each retry (``max_retries``, default 6)
is a new attempt with a deadline of its own: a request that keeps failing ends within
``(max_retries + 1) * timeout`` plus the waits between attempts (``backoff_base``,
``backoff_max``, ``jitter``, ``max_retry_after``). ``close()`` ends the requests in flight at
once (an interrupted run does not wait for them). An answer longer than ``max_tokens`` allows is
a server fault: cut, logged, and flagged with the finish reason ``oversized`` (see
:func:`agents.llm.common.finish_texts`).

The key comes only from the environment variable ``api_key_env`` (default ``OPENAI_API_KEY``);
a ``base_url`` server without one gets a dummy key. It never appears in ``describe()``,
``repr``, logs or errors raised here. ``OPENAI_ORG_ID`` and ``OPENAI_PROJECT_ID``, when set,
are sent as the OpenAI API's organization and project headers.

Grounded decoding (``Request.constraint``) uses the server's own constrained decoding, in the
dialect named by ``grammar_dialect``:

- ``"vllm"``: ``vllm serve``'s ``structured_outputs: {"regex": ...}`` extra parameter (vLLM
  0.10.2 and later; the default for a ``vllm:`` spec with ``base_url``);
- ``"vllm-guided"``: the older ``guided_regex`` parameter (vLLM before ``structured_outputs``;
  newer servers ignore it with only a warning, so never use it with them);
- ``"llamacpp"``: the ``grammar`` field (GBNF) of llama.cpp's server and of
  ``python -m llama_cpp.server``.

The regex and the grammar come from :mod:`agents.llm.grounding`. An ``openai:`` spec with
``base_url`` has no default (a server's dialect cannot be guessed safely); api.openai.com has
none at all: a constrained request there is a one-line :class:`SpecError` naming
``--action-decoding nearest``. Every constrained answer is checked against the constraint, so a
server that silently ignored the parameter is a :class:`BackendError`, not a wrong action.

``data_parallel_size`` N > 1 (set by ``--serve-data-parallel N``): the server is one URL in front
of N vLLM engines (``--data-parallel-size N``); every request carries an ``X-data-parallel-rank``
header, a stable hash of its game mod N (:func:`data_parallel_rank`), so that all the steps of an
episode, its reflection and the later trials of its game go to the engine whose prefix cache
holds them, instead of wherever vLLM's balancer sends each one.

``send_session_id`` (default: on for a ``vllm:`` spec with ``base_url``, off otherwise): an actor
request carries its episode's session id (:attr:`~agents.llm.base.Request.session`) as the
``session_id`` field of vLLM's completions and chat requests (0.32 and 0.34 have it), so that a
router in front of several servers or engines can keep an episode's KV cache together. vLLM's
request models ignore fields they do not know (older servers ignore this one); other servers
may refuse an unknown field, so an ``openai:`` spec sends it only when asked
(``send_session_id=true``), and never to api.openai.com.

Usage: prompt, completion and cached tokens as the server reports them (0 where it reports
none). ``extra_body`` is sent with every request (e.g. ``{"repeat_penalty": 1.0}`` for a
llama.cpp server, whose default of 1.1 differs from the OpenAI API's none).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from agents.llm.aio_http import Answer, HttpClient, gather_or_cancel
from agents.llm.answers import MalformedResponse, count, json_object
from agents.llm.base import ActionConstraint, BackendError, Completion, Request, SpecError
from agents.llm.common import (
    CONTINUE_INSTRUCTION,
    check_chat_format,
    finish_texts,
    grounding_error,
    key_scrubber,
    messages_as_dicts,
    opt_bool,
    opt_float,
    opt_int,
    prompt_as_messages,
    routing_key,
    safe_url,
    url_secrets,
)
from agents.llm.grounding import gbnf_for, regex_for, viable_prefix
from agents.llm.redaction import redact
from agents.llm.retry import (
    Retryable,
    RetryPolicy,
    acall_with_retries,
    classify_answer_error,
    parse_retry_after,
)

log = logging.getLogger("agents.llm.openai")

DUMMY_KEY = "sk-local-no-key"
OPENAI_API = "https://api.openai.com/v1"
ERROR_TEXT_CHARS = 2000  # of an error answer's body kept in the error's message
_MAX_STOPS = 4  # the OpenAI API accepts at most 4 stop strings; the rest are applied here
GRAMMAR_DIALECTS: dict[str, str] = {
    "vllm": "vLLM structured outputs (regex)",
    "vllm-guided": "vLLM guided_regex",
    "llamacpp": "llama.cpp server GBNF grammar",
}


def constraint_fields(dialect: str, constraint: ActionConstraint, newline: bool) -> dict[str, Any]:
    """The extra request fields that make a server of ``dialect`` enforce ``constraint``."""
    if dialect == "vllm":
        return {"structured_outputs": {"regex": regex_for(constraint, newline=newline)}}
    if dialect == "vllm-guided":
        return {"guided_regex": regex_for(constraint, newline=newline)}
    if dialect == "llamacpp":
        return {"grammar": gbnf_for(constraint, newline=newline)}
    raise SpecError(f"grammar_dialect={dialect!r} must be one of {', '.join(GRAMMAR_DIALECTS)}")


def data_parallel_rank(request: Request, size: int) -> int:
    """The engine (of ``size`` behind one vLLM URL) a request goes to: a stable hash of its game
    (else its prompt), the same in every process and run."""
    digest = hashlib.sha256(routing_key(request).encode()).digest()
    return int.from_bytes(digest[:8], "big") % size


class HTTPError(Exception):
    """The server refused a request with a status not worth retrying (400, 401, 404, ...):
    the status, and the server's message (``code``: the OpenAI API's error code, if any)."""

    def __init__(self, status: int, text: str, code: str | None) -> None:
        super().__init__(f"HTTP {status}: {text}" if text else f"HTTP {status}")
        self.status = status
        self.code = code


def status_error(answer: Answer) -> Exception:
    """What a non-2xx answer means: Retryable for 408, 409, 429 and 5xx (with its Retry-After),
    else an :class:`HTTPError`."""
    status = answer.status
    if status in (408, 409, 429) or status >= 500:
        return Retryable(f"HTTP {status}", parse_retry_after(answer.headers))
    text = answer.body.decode("utf-8", "replace").strip()
    code = None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("code") is not None:
            code = str(error["code"])
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
    return HTTPError(status, " ".join(text.split())[:ERROR_TEXT_CHARS], code)


class OpenAIBackend:
    """An OpenAI-compatible HTTP model. See the module docstring for the options."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api: str = "auto",
        chat_format: str | None = None,
        chat_instruction: str = CONTINUE_INSTRUCTION,
        concurrency: int | str = 8,
        timeout: float | str = 60.0,
        max_retries: int | str = 6,
        backoff_base: float | str = 1.0,
        backoff_max: float | str = 60.0,
        jitter: float | str = 1.0,
        max_retry_after: float | str = 120.0,
        api_key_env: str = "OPENAI_API_KEY",
        extra_body: Mapping[str, Any] | None = None,
        max_tokens_param: str | None = None,
        grammar_dialect: str | None = None,
        data_parallel_size: int | str = 1,
        send_session_id: bool | str | None = None,
        name: str | None = None,
    ) -> None:
        who = "openai"
        if not model:
            raise SpecError("openai needs a model: use openai:<model name>")
        if api not in ("auto", "completions", "chat"):
            raise SpecError(f"{who}: api={api!r} must be auto, completions or chat")
        self.model = model
        # OPENAI_BASE_URL, as the OpenAI SDK reads it; resolved here so describe() tells the truth
        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        self.base_url = base_url
        self.api, self.chat_format = _endpoint(api, chat_format, base_url)
        self.chat_instruction = chat_instruction
        self.concurrency = opt_int(who, "concurrency", concurrency, 1)
        self.data_parallel_size = opt_int(who, "data_parallel_size", data_parallel_size, 1)
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
        # o-series models reject max_tokens on chat; older compatible servers only know it
        self.max_tokens_param = max_tokens_param or (
            "max_tokens" if base_url else "max_completion_tokens"
        )
        self.name = name or f"openai:{model}"
        self.grammar_dialect = _dialect(self.name, base_url, grammar_dialect)
        self.send_session_id = _sends_session_id(self.name, base_url, send_session_id)
        self.api_key_env = api_key_env
        key = os.environ.get(api_key_env)
        if not key:
            if base_url is None:
                raise SpecError(
                    f"{self.name}: set the {api_key_env} environment variable "
                    "(or pass base_url= for a local OpenAI-compatible server)"
                )
            key = DUMMY_KEY
        # the key lives only in this closure and the request headers (and the URL's secrets)
        self._scrub = key_scrubber(key, *url_secrets(base_url))
        root, self._headers = _root_and_headers(base_url or OPENAI_API, key)
        self._urls = {"completions": f"{root}/completions", "chat": f"{root}/chat/completions"}
        self._http = HttpClient(
            url=root, width=self.concurrency, timeout=self.timeout, name=self.name
        )

    def __repr__(self) -> str:
        return f"OpenAIBackend(name={self.name!r}, base_url={safe_url(self.base_url)!r})"

    def describe(self) -> dict[str, Any]:
        """Everything needed to compare runs; safe to store (no key)."""
        return {
            "spec": self.name,
            "backend": "openai",
            "model": self.model,
            "base_url": safe_url(self.base_url),
            "api": self.api,
            "chat_format": self.chat_format,
            "chat_instruction": self.chat_instruction,
            "concurrency": self.concurrency,
            "timeout": self.timeout,
            "retry": self.policy.describe(),
            "api_key_env": self.api_key_env,
            "extra_body": self.extra_body,
            "max_tokens_param": self.max_tokens_param,
            "grammar_dialect": self.grammar_dialect,
            "data_parallel_size": self.data_parallel_size,
            "send_session_id": self.send_session_id,
        }

    @property
    def grounding(self) -> str | None:
        """How this backend enforces an ActionConstraint, or None (see ``grounding_missing``)."""
        return GRAMMAR_DIALECTS.get(self.grammar_dialect or "")

    @property
    def grounding_missing(self) -> str:
        if self.base_url is None:
            return "the OpenAI API takes no grammar or regex for completions"
        return (
            f"grammar_dialect is not set: pass grammar_dialect=vllm or llamacpp for the server "
            f"at {safe_url(self.base_url)}"
        )

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """The requests' answers, sent concurrently; the first failure is raised (the others
        are ended)."""
        try:
            return self._http.run(
                gather_or_cancel([self._one(i, r) for i, r in enumerate(requests)])
            )
        except _NoChatEndpoint as exc:
            raise SpecError(str(exc)) from None  # the run's config, not a request, is wrong

    async def agenerate(self, request: Request) -> Completion:
        """One request, sent from the caller's event loop (no thread)."""
        try:
            return await self._one(0, request)
        except _NoChatEndpoint as exc:
            raise SpecError(str(exc)) from None

    def _payload(self, request: Request) -> tuple[str, dict[str, Any]]:
        c = request.config
        params: dict[str, Any] = {
            "model": self.model,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "n": c.n,
        }
        if c.stop:
            params["stop"] = list(c.stop[:_MAX_STOPS])
        if c.seed is not None:
            params["seed"] = c.seed
        extra = dict(self.extra_body)
        if self.send_session_id and request.session is not None:
            extra["session_id"] = request.session
        if request.constraint is not None:
            if self.grammar_dialect is None:
                raise grounding_error(self.name, self.grounding_missing)
            extra.update(
                constraint_fields(self.grammar_dialect, request.constraint, "\n" in c.stop)
            )
        if request.prompt is not None and self.api == "completions":
            params["prompt"] = request.prompt
            params["max_tokens"] = c.max_tokens
            endpoint = "completions"
        else:
            if request.messages is not None:
                messages = messages_as_dicts(request.messages)
            else:
                assert request.prompt is not None
                messages = prompt_as_messages(
                    request.prompt, self.chat_format, self.chat_instruction
                )
                if self.chat_format == "prefill":
                    extra.setdefault("continue_final_message", True)
                    extra.setdefault("add_generation_prompt", False)
            params["messages"] = messages
            params[self.max_tokens_param] = c.max_tokens
            endpoint = "chat"
        if extra:
            params["extra_body"] = extra
        if self.data_parallel_size > 1:
            rank = data_parallel_rank(request, self.data_parallel_size)
            params["extra_headers"] = {"X-data-parallel-rank": str(rank)}
        return endpoint, params

    async def _one(self, index: int, request: Request) -> Completion:
        """One request on the backend's loop, counted among the ``concurrency`` in flight."""
        async with self._http.slot():
            return await self._send(index, request)

    async def _send(self, index: int, request: Request) -> Completion:
        endpoint, params = self._payload(request)
        url = self._urls[endpoint]
        body, headers = _wire(params, self._headers.value)

        async def call() -> Any:
            answer = await self._http.post(url, body, headers)
            if not 200 <= answer.status < 300:
                error = status_error(answer)
                no_chat = endpoint == "chat" and request.prompt is not None
                if no_chat and isinstance(error, HTTPError) and error.status == 404:
                    raise _NoChatEndpoint(self._no_chat_endpoint(error))
                raise error
            return _parse(endpoint, json.loads(answer.body))  # checked by _parse

        start = time.perf_counter()
        label = f"{self.name} request {index}"
        errors: list[str] = []
        (texts, finishes, usage), retries = await acall_with_retries(
            call,
            classify_answer_error,
            self.policy,
            log=log,
            label=label,
            sleep=self._http.sleep,
            scrub=self._scrub,
            cancelled=self._http.cancelled,
            errors=errors,
        )
        latency = time.perf_counter() - start
        cleaned, finish = finish_texts(
            list(zip(texts, finishes, strict=True)), request.config, log=log, label=label
        )
        for text in cleaned:
            if request.constraint is not None and not viable_prefix(
                request.constraint, text, newline=False
            ):
                raise BackendError(
                    f"{self.name}: the server ignored the {self.grammar_dialect} constraint "
                    f"(answered {text[:60]!r}); check grammar_dialect= (vllm, vllm-guided or "
                    "llamacpp) or use --action-decoding nearest",
                    retries=retries,
                )
        sent = {"endpoint": endpoint, **{k: v for k, v in params.items() if k != "extra_body"}}
        if "extra_body" in params:  # the user's part may hold a key: recorded without it
            extra = params["extra_body"]
            sent["extra_body"] = redact(extra) if self.extra_body else extra
        return Completion(
            text=cleaned[0],
            finish_reason=finish,
            prompt_tokens=usage[0],
            completion_tokens=usage[1],
            cached_tokens=usage[2],
            latency_s=latency,
            retries=retries,
            sent=sent,
            alternatives=tuple(cleaned[1:]),
            attempt_errors=tuple(errors),
        )

    def _no_chat_endpoint(self, exc: BaseException) -> str:
        said = self._scrub(str(exc))[:200]
        return (
            f"{self.name}: the server at {safe_url(self.base_url)} answered 404 to "
            f"/chat/completions ({said}): it has no chat endpoint for --chat-format "
            f"{self.chat_format}; pass --chat-format raw (or none) to send prompts as text to "
            "/completions"
        )

    def close(self) -> None:
        """End the requests in flight at once (they fail with a BackendError that says the
        backend was closed) and release the connections; waits for nothing."""
        self._http.close()


class _NoChatEndpoint(BackendError):
    """A wrapped prompt answered with 404: the server has no chat endpoint (not retried)."""


def _endpoint(api: str, chat_format: str | None, base_url: str | None) -> tuple[str, str]:
    """The endpoint prompts go to, and how they are sent there (see the module docstring)."""
    if chat_format is not None:
        chat_format = check_chat_format(chat_format, allow_raw=True, backend="openai")
    if api == "auto":
        if chat_format is None:
            return ("completions", "raw") if base_url else ("chat", "user")
        return ("completions" if chat_format == "raw" else "chat"), chat_format
    if api == "completions" and chat_format not in (None, "raw"):
        raise SpecError(
            f"openai: chat_format={chat_format!r} wraps prompts for the chat endpoint, but "
            "api=completions sends them as text: drop one of them"
        )
    if api == "chat" and chat_format == "raw":
        raise SpecError(
            "openai: chat_format='raw' sends prompts as text to the completions endpoint, but "
            "api=chat sends chat messages: drop one of them, or pass chat_format=user|prefill"
        )
    return api, ("raw" if api == "completions" else chat_format or "user")


def _dialect(name: str, base_url: str | None, dialect: str | None) -> str | None:
    """The grammar dialect: as given, else ``vllm`` for a ``vllm:`` spec served at base_url."""
    if dialect in (None, ""):
        return "vllm" if base_url and name.startswith("vllm:") else None
    if dialect == "none":
        return None
    if dialect not in GRAMMAR_DIALECTS:
        raise SpecError(
            f"openai: grammar_dialect={dialect!r} must be one of "
            f"{', '.join(GRAMMAR_DIALECTS)} or none"
        )
    if base_url is None:
        raise SpecError(
            "openai: grammar_dialect is for a local server (base_url=); the OpenAI API takes no "
            "grammar: use --action-decoding nearest"
        )
    return dialect


def _sends_session_id(name: str, base_url: str | None, value: bool | str | None) -> bool:
    """Whether requests carry ``session_id``: as given, else for a ``vllm:`` spec served at
    base_url (see the module docstring)."""
    if value is None or value == "":
        return bool(base_url) and name.startswith("vllm:")
    send = opt_bool("openai", "send_session_id", value)
    if send and base_url is None:
        raise SpecError(
            "openai: send_session_id is for a vLLM server or a router (base_url=); the OpenAI "
            "API refuses fields it does not know: drop send_session_id"
        )
    return send


class _Hidden:
    """Headers that hold the key, kept out of ``repr``."""

    __slots__ = ("value",)

    def __init__(self, value: dict[str, str]) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<headers>"


def _root_and_headers(base_url: str, key: str) -> tuple[str, _Hidden]:
    """The URL requests go under, and the headers every request carries: the key (as a bearer
    token; a user and password in the URL are sent as basic auth instead, as the OpenAI SDK
    does), and the OpenAI API's organization and project where the environment names them."""
    parts = urlsplit(base_url.rstrip("/"))
    auth = f"Bearer {key}"
    if parts.username is not None or parts.password is not None:
        user = unquote(parts.username or "")
        password = unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=host)
    headers = {
        "Authorization": auth,
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": "reflexsim",
    }
    for env, header in (
        ("OPENAI_ORG_ID", "OpenAI-Organization"),
        ("OPENAI_PROJECT_ID", "OpenAI-Project"),
    ):
        if os.environ.get(env):
            headers[header] = os.environ[env]
    return urlunsplit(parts), _Hidden(headers)


def _wire(params: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
    """A request's JSON body and headers from its parameters (``extra_body`` merged into the
    body, ``extra_headers`` into the headers, as the OpenAI SDK sends them)."""
    fields = {k: v for k, v in params.items() if k not in ("extra_body", "extra_headers")}
    fields.update(params.get("extra_body") or {})
    return json.dumps(fields).encode(), {**headers, **(params.get("extra_headers") or {})}


def _parse(endpoint: str, answer: Any) -> tuple[list[str], list[str], tuple[int, int, int]]:
    """Texts, finish reasons and (prompt, completion, cached) tokens of a 200 answer's JSON;
    MalformedResponse if it lacks them or its counts are no counts (:mod:`agents.llm.answers`)."""
    choices = json_object(answer, "the answer").get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedResponse("no choices")
    choices = sorted(
        (json_object(ch, "a choice") for ch in choices),
        key=lambda ch: ch["index"] if isinstance(ch.get("index"), int) else 0,
    )
    if endpoint == "completions":
        texts = [ch.get("text") for ch in choices]
    else:
        texts = [json_object(ch.get("message"), "a message").get("content") or "" for ch in choices]
    if not all(isinstance(t, str) for t in texts):
        raise MalformedResponse("a choice without text")
    finishes = [str(ch.get("finish_reason") or "stop") for ch in choices]
    usage = json_object(answer.get("usage"), "usage")
    details = json_object(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details")
    return (
        texts,
        finishes,
        (
            count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
            count(usage.get("completion_tokens"), "usage.completion_tokens"),
            count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens"),
        ),
    )
