"""Small helpers shared by the backends: stop truncation, chat wrapping, options, imports.

Completion-style prompts sent to chat models (``chat_format``):

- ``"raw"``: no wrapping; only for backends that can send text as is (llama.cpp, transformers,
  an OpenAI-compatible completions endpoint). The default for local models.
- ``"user"``: the whole prompt becomes one user message, preceded by :data:`CONTINUE_INSTRUCTION`
  (the ``chat_instruction`` option) and a blank line. The default for chat APIs (OpenAI chat,
  Anthropic): it works everywhere. An empty ``chat_instruction`` sends the prompt alone, as the
  paper's code does (``--protocol reflexion-code`` sets it for the actor).
- ``"prefill"``: the instruction is the user message and the prompt is an unfinished assistant
  message the model continues (Anthropic models that allow prefill; vLLM's chat endpoint with
  ``continue_final_message``). Closest to a completion model, but not every model accepts it.

Whatever a backend does, ``Completion.sent`` records the exact messages or text it sent.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from agents.llm.base import (
    OVERSIZED,
    ContextLimitError,
    GenerationConfig,
    Message,
    MissingDependencyError,
    Request,
    SpecError,
)
from agents.llm.redaction import redact
from memory.records import SentRequest

ChatFormat = Literal["raw", "user", "prefill"]
CHAT_FORMATS: tuple[str, ...] = ("raw", "user", "prefill")

CONTINUE_INSTRUCTION = (
    "Continue the text below from exactly where it stops. Reply with the continuation only: "
    "do not repeat the text and do not explain."
)


def truncate_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """Cut ``text`` at the earliest occurrence of any stop string (the stop itself dropped).

    Returns the text and whether a stop string was found. Empty stop strings are ignored.
    """
    cut = -1
    for s in stop:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (cut == -1 or i < cut):
            cut = i
    if cut == -1:
        return text, False
    return text[:cut], True


# The most characters a token may stand for: far above real text (about four characters a token
# in English; the longest tokens of common vocabularies are runs of a few dozen spaces or
# punctuation marks), so only a server that ignored max_tokens sends more than max_tokens times it.
MAX_CHARS_PER_TOKEN = 64


def finish_texts(
    answers: Sequence[tuple[str, str]],
    config: GenerationConfig,
    *,
    log: logging.Logger,
    label: str,
) -> tuple[list[str], str]:
    """A server's ``(text, finish reason)`` answers to one request as the agent gets them: the
    texts, and the completion's finish reason (its first answer's).

    Each text is cut at its first stop string (finish reason ``stop``). A text longer than
    ``config.max_tokens`` tokens can be (:data:`MAX_CHARS_PER_TOKEN` characters each) is a
    server fault, never passed on whole: it is cut to that length first and logged as a
    warning, and the completion's finish reason is :data:`~agents.llm.base.OVERSIZED`.
    """
    limit = config.max_tokens * MAX_CHARS_PER_TOKEN
    texts, finishes = [], []
    for text, finish in answers:
        if len(text) > limit:
            log.warning(
                "%s: the server sent %d characters for max_tokens=%d; cut to %d (finish %s)",
                label,
                len(text),
                config.max_tokens,
                limit,
                OVERSIZED,
            )
            text, finish = text[:limit], OVERSIZED
        text, hit = truncate_at_stop(text, config.stop)
        texts.append(text)
        finishes.append(finish if finish == OVERSIZED else "stop" if hit else finish)
    return texts, OVERSIZED if OVERSIZED in finishes else finishes[0]


def prompt_as_messages(
    prompt: str, chat_format: str, instruction: str = CONTINUE_INSTRUCTION
) -> list[dict[str, str]]:
    """Wrap a completion-style prompt as chat messages (see the module docstring); under
    ``"user"`` an empty ``instruction`` sends the prompt alone (as the paper's code does)."""
    if chat_format == "user":
        return [
            {"role": "user", "content": f"{instruction}\n\n{prompt}" if instruction else prompt}
        ]
    if chat_format == "prefill":
        return [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": prompt},
        ]
    raise SpecError(f"chat_format={chat_format!r} cannot wrap a prompt; use 'user' or 'prefill'")


def messages_as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def request_messages(
    request: Request, chat_format: str, instruction: str = CONTINUE_INSTRUCTION
) -> list[dict[str, str]]:
    """The chat messages for a request: its own messages, or its prompt wrapped."""
    if request.messages is not None:
        return messages_as_dicts(request.messages)
    assert request.prompt is not None
    return prompt_as_messages(request.prompt, chat_format, instruction)


def routing_key(request: Request) -> str:
    """What a request is routed by (a server, a data-parallel engine): its game, else its
    prompt (or messages) text."""
    game = request.site.game
    if game is not None:
        return f"game:{game}"
    if request.prompt is not None:
        return f"prompt:{request.prompt}"
    return "messages:" + "\n".join(f"{m.role}:{m.content}" for m in request.messages or ())


def check_chat_format(value: Any, *, allow_raw: bool, backend: str) -> str:
    allowed = CHAT_FORMATS if allow_raw else tuple(f for f in CHAT_FORMATS if f != "raw")
    if value not in allowed:
        raise SpecError(f"{backend}: chat_format={value!r} is not one of {', '.join(allowed)}")
    return str(value)


def safe_url(url: str | None) -> str | None:
    """A URL without user info, query or fragment: safe to store in a manifest."""
    if url is None:
        return None
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """Replace every secret (and any long piece of it) in ``text`` by ``<redacted>``."""
    for secret in secrets:
        if not secret or len(secret) < 8:
            continue
        text = text.replace(secret, "<redacted>")
        # servers echo masked keys ("sk-abc...wxyz"); drop any 8+ character run of the key too
        for size in (16, 12, 8):
            for i in range(0, len(secret) - size + 1):
                piece = secret[i : i + size]
                if piece in text:
                    text = text.replace(piece, "<redacted>")
    return text


def url_secrets(url: str | None) -> list[str]:
    """What ``safe_url`` drops from each of a (comma-separated) URL: user info, query values,
    the query and the fragment (a key may sit in any of them)."""
    out: list[str] = []
    for one in (url or "").split(","):
        parts = urlsplit(one.strip())
        out += [parts.password or "", parts.username or "", parts.query, parts.fragment]
        out += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
    return sorted({s for s in out if s}, key=len, reverse=True)


def key_scrubber(key: str, *others: str) -> Callable[[str], str]:
    """A function that blanks ``key`` (and ``others``: a base URL's ``url_secrets``) out of a
    text: they live only in its closure."""
    secrets = (key, *others)
    return lambda text: scrub(text, secrets)


def require(module: str, package: str, extra: str) -> Any:
    """Import an optional dependency, or raise :class:`MissingDependencyError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but broken: show the real cause
        raise MissingDependencyError(package, extra) from None


def opt_int(backend: str, name: str, value: Any, minimum: int | None = None) -> int:
    """An integer option (strings from a config are accepted), or a one-line SpecError."""
    try:
        number = int(value)
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        raise SpecError(f"{backend}: option {name}={value!r} must be an integer") from None
    if minimum is not None and number < minimum:
        raise SpecError(f"{backend}: option {name}={value!r} must be >= {minimum}")
    return number


def opt_float(backend: str, name: str, value: Any, minimum: float | None = None) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{backend}: option {name}={value!r} must be a number") from None
    if number != number or (minimum is not None and number < minimum):
        raise SpecError(f"{backend}: option {name}={value!r} must be a number >= {minimum}")
    return number


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def opt_bool(backend: str, name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise SpecError(f"{backend}: option {name}={value!r} must be true or false")


_WORD = re.compile(r"\w+|[^\w\s]")
_WORD_CHAR = re.compile(r"\w")


def rough_token_count(text: str) -> int:
    """Words and punctuation marks: a stand-in count for backends without a tokenizer."""
    return len(_WORD.findall(text))


class PrefixTokenCount:
    """:func:`rough_token_count` of texts that mostly extend the last one of their key (an
    episode's prompts): only the new tail is counted. Exact: a word split at the join is one
    token, counted once. Keeps the last text of at most ``keys`` keys."""

    def __init__(self, keys: int = 4096) -> None:
        self.keys = keys
        self._last: dict[Hashable, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, text: str) -> int:
        with self._lock:
            last = self._last.get(key)
        if last is not None and text.startswith(last[0]):
            before, count = last
            tail = text[len(before) :]
            count += rough_token_count(tail)
            if before and tail and _WORD_CHAR.match(before[-1]) and _WORD_CHAR.match(tail[0]):
                count -= 1  # one word across the join
        else:
            count = rough_token_count(text)
        with self._lock:
            self._last.pop(key, None)
            self._last[key] = (text, count)
            if len(self._last) > self.keys:
                del self._last[next(iter(self._last))]  # the least recently counted
        return count


def sampling_dict(request: Request) -> dict[str, Any]:
    """The sampling settings of a request as plain JSON (for ``Completion.sent``)."""
    c = request.config
    return {
        "temperature": c.temperature,
        "top_p": c.top_p,
        "max_tokens": c.max_tokens,
        "stop": list(c.stop),
        "seed": c.seed,
        "n": c.n,
    }


def sent_request(request: Request, sent: Any) -> SentRequest:
    """What the backend sent for ``request``, from its ``Completion.sent``: the prompt text or
    the chat messages it holds, and every other field sent (redacted: no key is ever kept). A
    ``sent`` that names no prompt or messages (a text rendered in process, a request that never
    got an answer) gives the request's own, with its sampling settings and constraint."""
    params: dict[str, Any] = dict(sent) if isinstance(sent, dict) else {}
    prompt, messages = params.pop("prompt", None), params.pop("messages", None)
    if isinstance(sent, str):
        prompt = sent
    pairs = _message_pairs(messages)
    if not isinstance(prompt, str) and pairs is None:
        prompt = request.prompt
        if request.messages is not None:
            pairs = tuple((m.role, m.content) for m in request.messages)
        if sent is not None and not isinstance(sent, str | dict):
            params["sent"] = repr(sent)
    if "sampling" not in params and "temperature" not in params:
        params["sampling"] = sampling_dict(request)
    c = request.constraint
    if c is not None and "extra_body" not in params:  # a server's spec is in its extra_body
        params.setdefault(
            "constraint", {"actions": list(c.actions), "allow_think": c.allow_think, "lead": c.lead}
        )
    clean = redact(params)
    if pairs is not None:
        return SentRequest(messages=pairs, params=clean)
    return SentRequest(prompt=prompt if isinstance(prompt, str) else "", params=clean)


def _message_pairs(messages: Any) -> tuple[tuple[str, str], ...] | None:
    """Chat messages as sent (``{"role", "content"}``; a content of text blocks joined) as
    (role, content) pairs; None when ``messages`` is none."""
    if not isinstance(messages, list | tuple):
        return None
    pairs = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if not isinstance(content, str):
            blocks = content if isinstance(content, list) else []
            content = "".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict))
        pairs.append((str(m.get("role", "")), content))
    return tuple(pairs)


def grounding_error(backend: str, reason: str) -> SpecError:
    """The one-line error of a backend asked for grounded decoding it cannot do."""
    return SpecError(
        f"{backend} cannot constrain decoding to the admissible commands ({reason}); "
        "use --action-decoding nearest instead"
    )


def check_grounding(backend: Any) -> str:
    """How ``backend`` enforces an :class:`~agents.llm.base.ActionConstraint` (its
    ``grounding`` attribute, e.g. ``"llama.cpp GBNF grammar"``), or the one-line
    :class:`SpecError` naming ``--action-decoding nearest`` when it cannot (the reason from its
    ``grounding_missing`` attribute). Call it before a grounded run starts."""
    mechanism = getattr(backend, "grounding", None)
    if isinstance(mechanism, str) and mechanism:
        return mechanism
    reason = getattr(backend, "grounding_missing", None) or "it has no constrained decoding"
    raise grounding_error(str(getattr(backend, "name", type(backend).__name__)), str(reason))


# How servers and engines say that a prompt does not fit the context: OpenAI's error code, and
# the wording of vLLM (engine and server), OpenAI and Anthropic. Each limit pattern's group is the
# context size; each prompt pattern's, the prompt's token count.
CONTEXT_LIMIT_CODE = "context_length_exceeded"
_LIMIT_WORDS = (
    re.compile(r"maximum (?:context|model) length (?:is|of) (\d+)"),
    re.compile(r"(?:does not fit|exceeds?) n_ctx[= ](\d+)"),
    re.compile(r"tokens > (\d+) maximum"),  # Anthropic: "prompt is too long: N tokens > M maximum"
)
_PROMPT_WORDS = re.compile(
    r"(?:prompt \(length|prompt contains|resulted in|you requested|prompt of|your request has"
    r"|too long:) (at least )?(\d+)"
)


def context_limit_error(
    message: str, code: str | None = None, who: str = "model"
) -> ContextLimitError | None:
    """The :class:`ContextLimitError` that an error ``message`` (and an API's error ``code``)
    describes, with the prompt's token count and the limit where the text names them; None when
    the error is about something else."""
    limit = next((m for m in (p.search(message) for p in _LIMIT_WORDS) if m), None)
    if limit is None and code != CONTEXT_LIMIT_CODE:
        return None
    prompt = _PROMPT_WORDS.search(message)
    tokens = int(prompt.group(2)) if prompt else None
    bound = "at least " if prompt and prompt.group(1) else ""
    size = int(limit.group(1)) if limit else None
    first = (message.strip().splitlines() or [""])[0][:300]
    return ContextLimitError(
        f"{who}: the prompt ({bound}{tokens if tokens is not None else '?'} tokens) does not fit "
        f"the context ({size if size is not None else '?'} tokens): {first}",
        prompt_tokens=tokens,
        limit=size,
        exact=not bound,
    )
