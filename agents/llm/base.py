"""The one model interface: a batch of requests in, completions out in the same order."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from agents.llm.answers import storable

log = logging.getLogger("agents.llm")

# What a request is for: the built-in purposes are act, reflect, judge, plan, value, insights
# and other; an arm may send purposes of its own (and route them to a model role of its own:
# agents.arm.ModelRole). Backends treat every purpose alike but act.
Purpose = str


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings. Never changed silently by a backend; ``max_tokens`` is always set."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 100
    stop: tuple[str, ...] = ("\n",)
    seed: int | None = 0
    n: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class ActionConstraint:
    """Grounded decoding: the completion must be exactly ``lead`` followed by either one of
    ``actions`` or (when ``allow_think``) a ``think: <text>`` line, then the stop.

    Backends that can constrain decoding (vLLM structured outputs, llama.cpp grammars,
    transformers logits processors) enforce it with the engine's own mechanism; a backend that
    cannot raises :class:`SpecError` naming ``nearest`` as the alternative.
    """

    actions: tuple[str, ...]
    allow_think: bool = True
    lead: str = " "  # what the model writes right after the prompt's final '>'

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(str(a) for a in self.actions))
        if not self.actions and not self.allow_think:
            raise ValueError("an ActionConstraint needs at least one action or allow_think")


@dataclass(frozen=True)
class CallSite:
    """Where a request comes from, and what the agent held when it asked: routing
    (:class:`~agents.llm.sharded.ShardedBackend` by ``game``), seeds and logs read the first
    part; scripted policies play from the second instead of parsing the prompt text. A real
    model never sees it, and it never holds ground truth (see :mod:`agents.llm.ground_truth`).
    """

    episode: str | None = None  # the episode's id
    game: str | None = None
    trial: int | None = None
    step: int | None = None  # how many steps the episode took before this request
    history: tuple[str, ...] = ()  # the episode's actions so far (thoughts as ``think: ...``)
    admissible: tuple[str, ...] = ()  # the game's admissible commands at this step
    candidate: str | None = None  # purpose "value": the action rated
    replan: bool = False  # purpose "plan": a replan after a failure signal
    reflection_format: str | None = None  # purpose "reflect": the format asked for

    def __post_init__(self) -> None:
        object.__setattr__(self, "history", tuple(str(a) for a in self.history))
        object.__setattr__(self, "admissible", tuple(str(a) for a in self.admissible))

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallSite:
        return cls(**data)


@dataclass(frozen=True)
class Request:
    """A completion-style ``prompt`` or chat ``messages`` (exactly one), with its sampling config
    and its :class:`CallSite` (``site``), which a real model never sees."""

    config: GenerationConfig
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    purpose: Purpose = "act"
    site: CallSite = field(default_factory=CallSite)
    constraint: ActionConstraint | None = None  # grounded decoding (see ActionConstraint)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a Request needs exactly one of prompt or messages")

    @property
    def session(self) -> str | None:
        """The session id an engine or a router keeps one conversation's KV cache together by
        (vLLM's ``session_id``): the call site's episode id (stable across resumes) on the
        actor's calls, whose prompts all extend the episode's one append-only prompt; None for
        other calls (a reflection, judge, plan or value prompt is a prompt of its own)."""
        return self.site.episode if self.purpose == "act" else None

    def to_json(self) -> dict[str, Any]:
        """The request as JSON-ready data, for a backend in another process."""
        return {
            "prompt": self.prompt,
            "messages": None if self.messages is None else [asdict(m) for m in self.messages],
            "purpose": self.purpose,
            "site": self.site.to_json(),
            "config": asdict(self.config),
            "constraint": None if self.constraint is None else asdict(self.constraint),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Request:
        """The inverse of :meth:`to_json`."""
        config = dict(data.get("config") or {})
        if "stop" in config:
            config["stop"] = tuple(config["stop"])
        messages, constraint = data.get("messages"), data.get("constraint")
        return cls(
            config=GenerationConfig(**config),
            prompt=data.get("prompt"),
            messages=None if messages is None else tuple(Message(**m) for m in messages),
            purpose=data.get("purpose", "act"),
            site=CallSite.from_json(data.get("site") or {}),
            constraint=None if constraint is None else ActionConstraint(**constraint),
        )


@dataclass(frozen=True)
class Completion:
    """One answer. ``sent`` records what actually went over the wire (e.g. chat messages).

    Its texts are always storable: what the backend gives is passed through
    :func:`agents.llm.answers.storable` here, once for every backend, and ``invalid_text``
    counts the code points replaced (the engine records an ``invalid_text`` event)."""

    text: str
    # "stop" | "length" | "error" | OVERSIZED (a server fault) | backend-specific
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    retries: int = 0
    sent: Any = None
    alternatives: tuple[str, ...] = ()  # the other texts when n > 1
    invalid_text: int = 0  # code points of the texts that could not be stored (replaced)
    attempt_errors: tuple[str, ...] = ()  # why each retried attempt failed, in order

    def __post_init__(self) -> None:
        text, bad = storable(self.text)
        others = [storable(t) for t in self.alternatives]
        bad += sum(n for _, n in others)
        if bad:
            object.__setattr__(self, "text", text)
            object.__setattr__(self, "alternatives", tuple(t for t, _ in others))
            object.__setattr__(self, "invalid_text", self.invalid_text + bad)
            log.warning(
                "the model's answer held %d code point(s) that cannot be stored (lone "
                "surrogates); replaced by U+FFFD",
                bad,
            )


OVERSIZED = "oversized"
"""The finish reason of a completion whose server sent more text than ``max_tokens`` allows: a
server fault. The text is cut to what ``max_tokens`` allows (see
:func:`agents.llm.common.finish_texts`), the backend logs a warning and the engine records an
``oversized`` event in the run store."""


@runtime_checkable
class Backend(Protocol):
    """A model. ``generate`` gets every pending request at once and answers in input order.

    A backend that talks to a server over HTTP sets ``scheduling = "per_request"``: the engine
    then sends each request on its own as it comes (in threads, bounded), so a slow answer holds
    up only its own episode. One that answers at once, with no I/O and no model to wait for
    (the scripted policies), sets ``scheduling = "inline"``: the engine calls it on its event
    loop. Others get whatever is pending, one batch at a time.
    """

    name: str

    def generate(self, requests: Sequence[Request]) -> list[Completion]: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncBackend(Protocol):
    """A backend with its own scheduler (vLLM's async engine): ``agenerate`` answers one
    request; the engine submits every pending request at once and the backend batches them."""

    name: str

    async def agenerate(self, request: Request) -> Completion: ...

    def close(self) -> None: ...


class BackendError(RuntimeError):
    """A request failed for a reason outside the agent (network, server, quota) after retries.

    The runner records it as an infrastructure error, never as the agent's failure.
    ``retries`` is how many retries were made before giving up and ``attempt_errors`` why each
    attempt failed (both recorded with the failed call).
    """

    def __init__(
        self, message: str = "", *, retries: int = 0, attempt_errors: Sequence[str] = ()
    ) -> None:
        super().__init__(storable(message)[0])  # a server's error text is untrusted too
        self.retries = retries
        self.attempt_errors = tuple(storable(e)[0] for e in attempt_errors)


class ContextLimitError(BackendError):
    """The prompt does not fit the model's context (llama.cpp ``n_ctx``, vLLM ``max_model_len``,
    an API's ``context_length_exceeded``): the episode's own failure (its prompt grew too long),
    recorded with the prompt's token count, never an infrastructure error and never retried.
    ``prompt_tokens``/``limit``: as the backend or server said (None where it did not);
    ``exact``: False where the count is a lower bound (a server that stops counting past its
    limit says "at least N")."""

    def __init__(
        self,
        message: str,
        *,
        prompt_tokens: int | None = None,
        limit: int | None = None,
        exact: bool = True,
    ) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.exact = exact


class ModelRestarted(BackendError):
    """The model's engine died (out of memory, a device fault) and was rebuilt: the requests it
    held were lost. The engine plays the episodes that were waiting on them again from the
    start, as fresh attempts."""


class MissingDependencyError(ImportError):
    """An optional dependency of a backend is not installed; the message names the extra."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed: run `pip install reflexsim[{extra}]` (or `pip install {package}`)"
        )
        self.package = package
        self.extra = extra


class SpecError(ValueError):
    """A model spec that cannot be used as given: it names no backend, takes a bad option, or
    its backend lacks what it needs to start (an API key variable); the message names the fix."""
