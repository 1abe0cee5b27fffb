"""A real local HTTP server speaking the OpenAI and Anthropic APIs, with injected faults.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages``
(Anthropic), ``GET /v1/models``, ``GET /health``. The answer text is a pure function of the
request's prompt (``answer(prompt_text) -> str``; the default is :func:`echo_answer`), so a test
can check every answer.

Faults are decided per (request content, attempt number) from a seeded hash, so a run is the same
whatever order concurrent requests arrive in. Kinds:

- ``timeout``: sleep ``timeout_s`` before answering (the client should give up sooner);
- ``429``: ``Retry-After: <retry_after>`` with a JSON error body;
- ``500`` / ``503``: a JSON error body;
- ``reset``: the connection is reset (TCP RST) after the request is read;
- ``drop``: the connection is closed without an answer;
- ``malformed``: ``200`` with a truncated JSON body;
- ``trickle``: ``200`` with a good answer's headers, then its body one byte every
  ``trickle_s`` seconds (a per-chunk read timeout never fires);
- ``endless``: ``200`` with a chunked body that never ends (a chunk every ``trickle_s``).

``trickle`` and ``endless`` are never picked by default (they hold a request until the client
gives up): name them in ``kinds``. Neither are the misbehaviours of a server that answers
``200`` with what it should not (:data:`ODD_ANSWERS`, :data:`BROKEN_ANSWERS`):

- ``surrogate``: the answer's text holds a lone UTF-16 surrogate (JSON ``"\ud800"``);
- ``control``: the answer's text holds control characters and terminal escapes;
- ``huge``: the answer's text is 10 MB long, whatever ``max_tokens`` asked;
- ``garbage``: the text is lines no rule extraction or rating understands (``AGREE`` with 5,000
  digits, ``EDIT 0:``, ``REMOVE`` of a rule that is not there, escapes);
- ``negative_usage``, ``string_usage``, ``infinite_usage``: the usage's token counts are
  -1,000,000,000, the string ``"12"``, or ``Infinity`` (which Python's JSON reader accepts);
- ``empty_choices``: no choice (an Anthropic answer: no content);
- ``cut``: a good answer's headers and half its body, then the connection is closed;
- ``odd_error``: ``400`` whose message holds terminal escapes and a lone surrogate.

``routes`` names the endpoints the server has (default all three: ``ROUTES``); a POST to
another is ``404`` (a server with no chat endpoint: ``routes=("/completions",)``). Every POST's
path is recorded (:attr:`FaultServer.paths`), routed or not.

A request with a wrong key (see ``api_key``) is recorded as fault ``401``. With
``context_words``, a prompt of more words than that gets OpenAI's ``400``
``context_length_exceeded`` error (fault ``context``), its word count in the message.

Usage::

    with FaultServer(FaultPlan(rate=0.2)) as server:
        backend = make_backend("openai:test", base_url=server.url)
        ...
        server.stats()  # faults injected by kind, requests seen

``engine`` gives the good answers a model's timing and token counts: a thread that serves one
waits in ``engine.complete(prompt_text, answers)`` until they are generated, the answer's
usage is the counts it returns (``cached_tokens`` among them), and ``GET /stats`` is
``engine.stats()`` (see :mod:`tests.support.gpu_standin`). A prompt the engine cannot hold
(``ValueError``) gets ``400``.

``api_key`` makes the server check ``Authorization: Bearer`` / ``x-api-key``; a wrong key gets
401 with the key echoed in the error (as some servers do), to test that clients scrub it.
Usable from any test: it needs the standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

ROUTES = ("/chat/completions", "/completions", "/messages")
FAULT_KINDS = ("timeout", "429", "500", "reset", "malformed")
# answered 200 with text a client must take as it is (and store)
ODD_ANSWERS = ("surrogate", "control", "huge", "garbage")
# answered 200 with what is no answer: a client retries them as server faults
# (with ``malformed``, a truncated JSON body)
BROKEN_ANSWERS = ("negative_usage", "string_usage", "infinite_usage", "empty_choices", "cut")
ALL_FAULT_KINDS = (
    *FAULT_KINDS, "503", "drop", "trickle", "endless", *ODD_ANSWERS, *BROKEN_ANSWERS, "odd_error",
)  # fmt: skip
HUGE_CHARS = 10_000_000
CONTROLS = "\x00\x07\x1b[2J\x1b]0;pwned\x07\x7f\x9b"
GARBAGE = (
    f"AGREE {'9' * 5000}\nEDIT 0: nothing\nREMOVE 99999999999\nADD:\nEDIT {'7' * 4400}: x\n"
    f"{CONTROLS}\n10{'0' * 5000}"
)


def odd_text(kind: str, text: str) -> str:
    """The text a server misbehaving as ``kind`` (one of :data:`ODD_ANSWERS`) sends for ``text``."""
    if kind == "surrogate":
        return text[:3] + "\ud800" + text[3:]
    if kind == "control":
        return text[:3] + CONTROLS + text[3:]
    if kind == "huge":
        return (text + " ") * (HUGE_CHARS // (len(text) + 1) + 1)
    return GARBAGE


def broken(kind: str, route: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (a good answer on ``route``) as a server misbehaving as ``kind`` (one of
    :data:`BROKEN_ANSWERS`) sends it."""
    bad = {"negative_usage": -1_000_000_000, "string_usage": "12", "infinite_usage": math.inf}
    if kind in bad:
        usage = payload["usage"]
        for key in [k for k in usage if k.endswith("_tokens") and k != "total_tokens"]:
            usage[key] = bad[kind]
    elif kind == "empty_choices" and route == "/messages":
        payload["content"] = None
    elif kind == "empty_choices":
        payload["choices"] = []
    return payload


def echo_answer(prompt_text: str) -> str:
    """The default answer: `` ok <first 10 hex digits of sha256(prompt)>``."""
    return " ok " + hashlib.sha256(prompt_text.encode("utf-8")).hexdigest()[:10]


def word_count(text: str) -> int:
    """The fault server's token count: whitespace-separated words (deterministic, checkable)."""
    return len(text.split())


def prompt_text_of(body: dict[str, Any]) -> str:
    """The text an answer is derived from: the prompt, or the messages as role: content lines."""
    if "prompt" in body:
        prompt = body["prompt"]
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    parts = []
    system = body.get("system")
    if system:
        parts.append(f"system: {system if isinstance(system, str) else json.dumps(system)}")
    for m in body.get("messages", []):
        content = m.get("content")
        if not isinstance(content, str):
            content = "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))
        parts.append(f"{m.get('role')}: {content}")
    return "\n".join(parts)


@dataclass(frozen=True)
class FaultPlan:
    """Which faults to inject. ``rate`` is the probability per attempt."""

    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    timeout_s: float = 2.0
    retry_after: str = "1"
    max_faults_per_key: int | None = None  # after this many faults a request always succeeds
    latency_s: float = 0.0  # added to every good answer (to model a slow server)
    # every request whose prompt contains this text fails with a 500, every attempt
    always_fail: str | None = None
    # seconds a good answer waits, from the prompt text (e.g. a seeded lognormal draw)
    delay: Callable[[str], float] | None = None
    trickle_s: float = 0.1  # seconds between the bytes (trickle) or chunks (endless) of a body
    context_words: int | None = None  # the model's context, in words (word_count)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(ALL_FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {ALL_FAULT_KINDS}")


class Timing(Protocol):
    """A model's timing behind the server (see ``engine`` above)."""

    def complete(self, prompt: str, answers: list[str]) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens, once the answers are generated."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


@dataclass
class Event:
    """One request as the server saw it; ``answered`` is None while it is still in flight."""

    key: str
    attempt: int
    fault: str | None  # None for a good answer
    arrived: float
    answered: float | None = None
    delay: float = 0.0  # the latency the server added to a good answer


@dataclass
class _State:
    plan: FaultPlan
    answer: Callable[[str], str]
    api_key: str | None
    routes: tuple[str, ...] = ROUTES
    engine: Timing | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: Counter[str] = field(default_factory=Counter)
    faults_of: Counter[str] = field(default_factory=Counter)
    events: list[Event] = field(default_factory=list)
    keys_seen: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


def _unit(seed: int, key: str, attempt: int, salt: str) -> float:
    h = hashlib.sha256(f"{seed}|{key}|{attempt}|{salt}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    _text = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass  # keep test output clean

    # -- plumbing ------------------------------------------------------------------------------
    def _head(self, status: int, raw: bytes, headers: dict[str, str] | None = None) -> None:
        """The status line and headers of a JSON answer whose body is ``raw``."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.flush()

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self._head(status, raw, headers)
        self.wfile.write(raw)
        self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802 - stdlib's name
        if self.path.rstrip("/") in ("/health", ""):
            self._send(200, {"status": "ok"})
        elif self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": "fault-model", "object": "model"}]})
        elif self.path.rstrip("/").endswith("/stats") and self.server.state.engine is not None:
            self._send(200, self.server.state.engine.stats())
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 - stdlib's name
        arrived = time.monotonic()
        state = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        path = self.path.split("?")[0].rstrip("/")
        with state.lock:
            state.paths.append(path)
        route = next((r for r in ROUTES if path.endswith(r)), None)
        if route is None or route not in state.routes:
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, {"error": {"message": "request body is not JSON"}})
            return
        key_given = self._api_key_given()
        with state.lock:
            state.keys_seen.append(key_given or "")
            state.bodies.append(body)
            state.headers.append({k.lower(): v for k, v in self.headers.items()})
        if state.api_key is not None and key_given != state.api_key:
            self._pick_fault("unauthorized", arrived, forced="401")
            self._send(
                401,
                {"error": {"message": f"Incorrect API key provided: {key_given}", "type": "auth"}},
            )
            return
        text = prompt_text_of(body)
        self._text = text
        key = hashlib.sha256(f"{route}|{text}".encode()).hexdigest()[:16]
        limit = state.plan.context_words
        if limit is not None and word_count(text) > limit:
            self._pick_fault(key, arrived, forced="context")
            message = (
                f"This model's maximum context length is {limit} tokens. However, your messages "
                f"resulted in {word_count(text)} tokens. Please reduce the length of the messages."
            )
            error = {"message": message, "type": "invalid_request_error"}
            self._send(
                400, {"error": {**error, "param": "messages", "code": "context_length_exceeded"}}
            )
            return
        event = self._pick_fault(key, arrived)
        if event.fault is None:
            wait = state.plan.latency_s + (state.plan.delay(text) if state.plan.delay else 0.0)
            if wait:
                time.sleep(wait)
            event.delay = wait
            self._answer(route, body, text)
        else:
            self._inject(event.fault, route, body, text)
        event.answered = time.monotonic()

    def _api_key_given(self) -> str | None:
        auth = self.headers.get("Authorization")
        if auth and auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return self.headers.get("x-api-key")

    def _pick_fault(self, key: str, arrived: float, forced: str | None = None) -> Event:
        state = self.server.state
        plan = state.plan
        with state.lock:
            attempt = state.attempts[key]
            state.attempts[key] += 1
            kind: str | None = forced
            capped = (
                plan.max_faults_per_key is not None
                and state.faults_of[key] >= plan.max_faults_per_key
            )
            if forced is None and plan.always_fail and plan.always_fail in self._text:
                kind = "500"
            elif forced is None and plan.rate > 0 and plan.kinds and not capped:
                if _unit(plan.seed, key, attempt, "fault?") < plan.rate:
                    pick = int(_unit(plan.seed, key, attempt, "kind") * len(plan.kinds))
                    kind = plan.kinds[pick]
                    state.faults_of[key] += 1
            event = Event(key, attempt, kind, arrived)
            state.events.append(event)
            return event

    # -- answers -------------------------------------------------------------------------------
    def _answer(
        self,
        route: str,
        body: dict[str, Any],
        text: str,
        send: Callable[..., None] | None = None,
        fault: str | None = None,
    ) -> None:
        """The good answer, sent by ``send`` (default :meth:`_send`), or the answer a server
        misbehaving as ``fault`` (one of :data:`ODD_ANSWERS` or :data:`BROKEN_ANSWERS`) sends."""
        send = send or self._send
        state = self.server.state
        n = int(body.get("n") or 1)
        answers = [state.answer(text) + (f" #{i}" if i else "") for i in range(n)]
        if fault in ODD_ANSWERS:
            answers = [odd_text(fault, a) for a in answers]
        stops = body.get("stop") if route != "/messages" else body.get("stop_sequences")
        if isinstance(stops, str):
            stops = [stops]
        finish = []
        for i, a in enumerate(answers):
            cut = min((a.find(s) for s in stops or [] if s and s in a), default=-1)
            if cut >= 0:
                answers[i] = a[:cut]
            finish.append("stop")
        prompt_tokens = word_count(text)
        completion_tokens = sum(word_count(a) for a in answers)
        cached_tokens = prompt_tokens // 2
        if state.engine is not None:
            try:
                prompt_tokens, completion_tokens, cached_tokens = state.engine.complete(
                    text, answers
                )
            except ValueError as exc:
                self._error(route, 400, str(exc))
                return
        model = body.get("model", "fault-model")
        answered = list(enumerate(zip(answers, finish, strict=True)))
        payload: dict[str, Any]
        if route == "/messages":
            payload = {
                "id": "msg_fault",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": answers[0]}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": prompt_tokens - cached_tokens,
                    "cache_read_input_tokens": cached_tokens,
                    "cache_creation_input_tokens": 0,
                    "output_tokens": word_count(answers[0]),
                },
            }
        elif route == "/completions":
            payload = {
                "id": "cmpl-fault",
                "object": "text_completion",
                "choices": [
                    {"index": i, "text": a, "finish_reason": f, "logprobs": None}
                    for i, (a, f) in answered
                ],
            }
        else:
            payload = {
                "id": "chatcmpl-fault",
                "object": "chat.completion",
                "choices": [
                    {"index": i, "message": {"role": "assistant", "content": a}, "finish_reason": f}
                    for i, (a, f) in answered
                ],
            }
        if route != "/messages":
            payload["created"] = int(time.time())
            payload["model"] = model
            payload["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens},
            }
        send(200, broken(fault, route, payload) if fault in BROKEN_ANSWERS else payload)

    def _error(
        self, route: str, status: int, message: str, headers: dict[str, str] | None = None
    ) -> None:
        if route == "/messages":
            kind = {429: "rate_limit_error", 503: "overloaded_error"}.get(status, "api_error")
            payload: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            payload = {"error": {"message": message, "type": "server_error", "code": status}}
        self._send(status, payload, headers)

    def _trickle(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        """A good answer's headers, then its body a byte at a time, until it is sent or the
        client has gone."""
        raw = json.dumps(payload).encode()
        self._head(status, raw, headers)
        try:
            for i in range(len(raw)):
                time.sleep(self.server.state.plan.trickle_s)
                self.wfile.write(raw[i : i + 1])
                self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _cut(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        """A good answer's headers and half its body, then the connection is closed."""
        raw = json.dumps(payload).encode()
        self._head(status, raw, headers)
        self.wfile.write(raw[: len(raw) // 2])
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
        self.close_connection = True

    def _endless(self) -> None:
        """``200`` and a chunked body that never ends, until the client has gone."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(b"1\r\n{\r\n")
            while True:
                self.wfile.flush()
                time.sleep(self.server.state.plan.trickle_s)
                self.wfile.write(b'8\r\n"aaaaaa"\r\n')
        except OSError:
            pass

    def _inject(self, fault: str, route: str, body: dict[str, Any], text: str) -> None:
        plan = self.server.state.plan
        if fault in ODD_ANSWERS or fault in BROKEN_ANSWERS:
            self._answer(route, body, text, send=self._cut if fault == "cut" else None, fault=fault)
        elif fault == "trickle":
            self._answer(route, body, text, send=self._trickle)
        elif fault == "endless":
            self._endless()
        elif fault == "timeout":
            time.sleep(plan.timeout_s)
            try:
                self._error(route, 504, "too slow")
            except OSError:
                pass  # the client has gone
        elif fault == "429":
            self._error(route, 429, "rate limited", {"Retry-After": plan.retry_after})
        elif fault in ("500", "503"):
            self._error(route, int(fault), f"injected {fault}")
        elif fault == "odd_error":
            self._error(route, 400, f"bad request {CONTROLS} \ud800 here")
        elif fault == "malformed":
            self._send(200, b'{"id": "cmpl-fault", "object": "text_completion", "choices": [{"te')
        elif fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        elif fault == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.connection.close()
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # the stdlib's 5 drops connections under a concurrent burst
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    state: _State

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # injected resets make the stdlib print tracebacks; they are expected


class FaultServer:
    """The server, run in a background thread on 127.0.0.1 (a free port unless given)."""

    def __init__(
        self,
        plan: FaultPlan | None = None,
        *,
        answer: Callable[[str], str] = echo_answer,
        api_key: str | None = None,
        routes: tuple[str, ...] = ROUTES,
        host: str = "127.0.0.1",
        port: int = 0,
        engine: Timing | None = None,
    ) -> None:
        self.plan = plan or FaultPlan()
        self._httpd = _Server((host, port), _Handler)
        self._httpd.state = _State(
            plan=self.plan, answer=answer, api_key=api_key, routes=tuple(routes), engine=engine
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-style base URL (``.../v1``)."""
        return f"{self.root}/v1"

    def start(self) -> FaultServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._httpd.state.engine is not None:
            self._httpd.state.engine.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what happened -------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Every request in arrival order (copies; a request in flight has ``answered=None``)."""
        with self._httpd.state.lock:
            return [dataclasses.replace(e) for e in self._httpd.state.events]

    @property
    def keys_seen(self) -> list[str]:
        with self._httpd.state.lock:
            return list(self._httpd.state.keys_seen)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        with self._httpd.state.lock:
            return list(self._httpd.state.bodies)

    @property
    def paths(self) -> list[str]:
        """The path of every POST, in arrival order (``/v1/chat/completions``, ...)."""
        with self._httpd.state.lock:
            return list(self._httpd.state.paths)

    @property
    def headers(self) -> list[dict[str, str]]:
        """Each request's headers (names in lower case), in the order of :attr:`bodies`."""
        with self._httpd.state.lock:
            return list(self._httpd.state.headers)

    @property
    def engine(self) -> Timing | None:
        return self._httpd.state.engine

    def stats(self) -> dict[str, int]:
        """``{"requests": n, "answered": n, <fault kind>: n, ...}``."""
        counts: Counter[str] = Counter()
        for e in self.events:
            counts["requests"] += 1
            counts[e.fault or "answered"] += 1
        return dict(counts)
