"""A GPU stand-in: an LLM engine's timing under continuous batching, from published figures.

:class:`Engine` is the simulator, on a virtual clock (no threads, no sleeps): requests go in
with :meth:`Engine.add`, :meth:`Engine.step` runs one engine iteration and returns what it did.
It schedules as vLLM's V1 engine does:

- every iteration takes at most ``max_num_batched_tokens`` new tokens: one per running sequence
  that decodes, and chunks of the prompts being prefilled (chunked prefill); running sequences
  first, then waiting ones, first come first served, up to ``max_num_seqs`` running;
- its time is a roofline from :class:`GpuPreset`: memory-bound, the weights plus every scheduled
  sequence's KV cache read once from HBM; or compute-bound, all its new tokens at the prefill
  rate; whichever is longer (:meth:`GpuPreset.iteration_s`);
- the KV cache is ``block_tokens`` (16) token blocks, as many as fit in the memory left after
  the weights (:attr:`GpuPreset.kv_capacity_tokens`, or ``kv_capacity_tokens=``). A block whose
  16 tokens are computed is known by a hash of its tokens and of every token before it (the
  prefix cache); a finished sequence's blocks stay cached until evicted, least recently used
  first (a sequence's blocks are freed last-first, so its prefix outlives its tail). A request's
  prompt reuses its longest cached prefix of whole blocks, short of its last token;
  that count is its ``cached_tokens`` (vLLM's ``usage.prompt_tokens_details.cached_tokens``);
- a waiting request is admitted only when the blocks its scheduled tokens need are free; a
  running sequence that needs a block when none is free preempts the sequence admitted last,
  which frees its blocks (they stay cached) and waits at the head of the queue to be computed
  again (vLLM's recompute preemption).

:class:`LiveEngine` runs an :class:`Engine` in real time, scaled by ``time_scale`` (0.1: ten
times faster than the simulated GPU), for threads that each wait for their answer
(:meth:`LiveEngine.complete`); :func:`standin_server` puts it behind the OpenAI-compatible
:class:`~tests.support.fault_server.FaultServer`, answering from a ``scripted:`` policy that reads
the prompt text (:func:`text_policy`), with ``GET /stats`` for the busy time. Tokens are the
project's stand-in count (words and punctuation marks, :func:`agents.llm.common.rough_token_count`),
plus one for the stop a model writes at the end of its answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from agents.llm.base import CallSite, Completion, GenerationConfig, Request
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.llm.markers import TASK_LINE
from agents.llm.scripted import ScriptedBackend
from tests.support.fault_server import FaultPlan, FaultServer

_TOKEN = re.compile(r"\w+|[^\w\s]")  # the tokens rough_token_count counts

# Llama-3.1-8B (model card and config.json): 8.03e9 parameters in bf16 (2 bytes); 32 layers,
# 8 KV heads of 128 dimensions, K and V in bf16: 32 * 8 * 128 * 2 * 2 = 131,072 bytes a token.
LLAMA_8B_WEIGHT_BYTES = 8.03e9 * 2
LLAMA_8B_KV_BYTES = 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True)
class GpuPreset:
    """One model on one GPU. The defaults are vLLM's on a GPU of 70 GiB or more."""

    name: str
    weight_bytes: float
    kv_bytes_per_token: float
    hbm_bytes_per_s: float  # the datasheet's HBM bandwidth
    hbm_bytes: float  # the datasheet's memory
    prefill_tokens_per_s: float  # tokens a second when compute-bound
    gpu_memory_utilization: float = 0.9  # vLLM's default share of the GPU's memory
    block_tokens: int = 16  # vLLM's default block_size
    max_num_seqs: int = 1024  # vLLM's default on a >= 70 GiB GPU (EngineArgs.get_batch_defaults)
    max_num_batched_tokens: int = 8192  # the same, for `vllm serve`

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache in what the weights leave of vLLM's share, in whole blocks."""
        free = self.hbm_bytes * self.gpu_memory_utilization - self.weight_bytes
        blocks = int(free // (self.kv_bytes_per_token * self.block_tokens))
        return blocks * self.block_tokens

    def iteration_s(self, new_tokens: int, context_tokens: int) -> float:
        """One iteration's time: the weights and ``context_tokens`` of KV read from HBM, or
        ``new_tokens`` at the prefill rate, whichever takes longer."""
        read = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return max(read / self.hbm_bytes_per_s, new_tokens / self.prefill_tokens_per_s)


# NVIDIA's datasheets: H100 SXM 80 GB at 3.35 TB/s, H200 141 GB at 4.8 TB/s, the same GH100
# compute (989 TFLOPS dense bf16). Prefill of an 8B model: 22.5k tokens/s, the middle of the
# ~20-25k usually quoted for an H100 (36% of the peak at 2 * 8.03e9 FLOPs a token); the H200's
# compute is the H100's, so its rate too.
H100_8B = GpuPreset(
    "llama-3.1-8b/h100", LLAMA_8B_WEIGHT_BYTES, LLAMA_8B_KV_BYTES, 3.35e12, 80e9, 22_500
)
H200_8B = GpuPreset(
    "llama-3.1-8b/h200", LLAMA_8B_WEIGHT_BYTES, LLAMA_8B_KV_BYTES, 4.8e12, 141e9, 22_500
)
PRESETS = {"h100-8b": H100_8B, "h200-8b": H200_8B}


class BlockPool:
    """KV blocks: in use (counted references) or free; a free block keeps its cached tokens
    until it is taken again, the least recently freed first."""

    def __init__(self, n_blocks: int) -> None:
        self.refs = [0] * n_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.cached: dict[Hashable, int] = {}  # block hash -> block
        self.hash_of: dict[int, Hashable] = {}
        self.evictions = 0  # cached blocks taken for other tokens

    def hits(self, hashes: list[Hashable]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``."""
        out = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def take(self, blocks: list[int]) -> None:
        """A reference to each of ``blocks`` (cache hits)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, evicting what they cached (the caller checked there are)."""
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.cached[h]
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop a reference to each block, last first: a sequence's tail is evicted before its
        prefix."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def register(self, block: int, h: Hashable) -> None:
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h


@dataclass
class Seq:
    """One request in the engine: its prompt and answer tokens, and how far it got."""

    rid: int
    prompt_len: int
    out_len: int  # tokens it generates (>= 1)
    hashes: list[Hashable]  # of each whole block of prompt + answer
    computed: int = 0  # tokens whose KV is in its blocks
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # the prefix-cache hit when first admitted
    preemptions: int = 0

    def to_feed(self) -> int:
        """Tokens to compute before it samples its next token."""
        return self.prompt_len + self.generated - self.computed


@dataclass(frozen=True)
class Iteration:
    """What one engine iteration did."""

    duration_s: float
    seqs: int  # sequences in the batch
    decode: int  # of which decoded a token
    prefill_tokens: int
    context_tokens: int  # KV tokens read
    finished: tuple[Seq, ...]
    preempted: tuple[int, ...]  # request ids


class Engine:
    """The simulator on a virtual clock (module docstring)."""

    def __init__(self, preset: GpuPreset, *, kv_capacity_tokens: int | None = None) -> None:
        self.preset = preset
        self.block = preset.block_tokens
        capacity = preset.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        self.pool = BlockPool(capacity // self.block)
        self.max_model_len = len(self.pool.refs) * self.block
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.clock = 0.0  # simulated seconds
        self.busy_s = 0.0  # simulated seconds with a non-empty batch
        self.iterations = self.preemptions = self._next_id = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def add(self, prompt: list[str], answer: list[str]) -> Seq:
        """Queue a request whose answer will be ``answer`` (its stop included)."""
        if not answer:
            raise ValueError("an answer has at least one token (its stop)")
        tokens = prompt + answer
        if len(tokens) > self.max_model_len:
            raise ValueError(f"{len(tokens)} tokens exceed the KV cache's {self.max_model_len}")
        hashes: list[Hashable] = []
        parent = ""
        for i in range(0, len(tokens) - self.block + 1, self.block):
            parent = hashlib.blake2b(
                "\x00".join([parent, *tokens[i : i + self.block]]).encode(), digest_size=12
            ).hexdigest()
            hashes.append(parent)
        seq = Seq(self._next_id, len(prompt), len(answer), hashes)
        self._next_id += 1
        self.waiting.append(seq)
        self.prompt_tokens += len(prompt)
        return seq

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block)

    def _preempt(self, seq: Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed = [], 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule(self) -> tuple[list[tuple[Seq, int]], list[int]]:
        budget = self.preset.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        preempted: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.to_feed(), budget)
            need = self._blocks_for(seq.computed + n) - len(seq.blocks)
            while need > len(self.pool.free) and self.running[-1] is not seq:
                victim = self.running.pop()  # the last admitted gives way
                self._preempt(victim)
                preempted.append(victim.rid)
            if need > len(self.pool.free):  # it is the last itself
                self._preempt(self.running.pop())
                preempted.append(seq.rid)
                break
            seq.blocks += self.pool.allocate(need)
            batch.append((seq, n))
            budget -= n
            i += 1
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.preset.max_num_seqs
        ):
            seq = self.waiting[0]
            feed = seq.prompt_len + seq.generated
            hits = self.pool.hits(seq.hashes[: (feed - 1) // self.block])
            computed = len(hits) * self.block
            n = min(feed - computed, budget)
            need = self._blocks_for(computed + n) - len(hits)
            if need > len(self.pool.free) - sum(self.pool.refs[b] == 0 for b in hits):
                break  # admitted when blocks are freed
            self.waiting.popleft()
            self.pool.take(hits)
            seq.blocks = hits + self.pool.allocate(need)
            seq.computed = computed
            if seq.cached_tokens is None:
                seq.cached_tokens = computed
                self.cached_tokens += computed
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch, preempted

    def step(self) -> Iteration | None:
        """Schedule and run one iteration (the clock moves by its time); None when idle."""
        batch, preempted = self._schedule()
        if not batch:
            if self.waiting and not self.running:
                raise RuntimeError("a waiting request cannot fit in the empty KV cache")
            return None
        decode = sum(1 for s, n in batch if s.generated > 0 and s.to_feed() == n == 1)
        new = sum(n for _, n in batch)
        context = sum(s.computed + n for s, n in batch)
        duration = self.preset.iteration_s(new, context)
        finished = []
        for seq, n in batch:
            before = seq.computed // self.block
            seq.computed += n
            for j in range(before, min(seq.computed // self.block, len(seq.hashes))):
                self.pool.register(seq.blocks[j], seq.hashes[j])
            if seq.to_feed() == 0:
                seq.generated += 1
                if seq.generated == seq.out_len:
                    self.running.remove(seq)
                    self.pool.release(seq.blocks)
                    seq.blocks = []
                    self.completion_tokens += seq.out_len
                    finished.append(seq)
        self.clock += duration
        self.busy_s += duration
        self.iterations += 1
        return Iteration(
            duration, len(batch), decode, new - decode, context, tuple(finished), tuple(preempted)
        )

    def stats(self) -> dict[str, Any]:
        return {
            "preset": self.preset.name,
            "busy_s": self.busy_s,
            "iterations": self.iterations,
            "requests": self._next_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "preemptions": self.preemptions,
            "evictions": self.pool.evictions,
            "kv_capacity_tokens": self.max_model_len,
        }


def tokens_of(text: str) -> list[str]:
    """The stand-in's tokens of ``text`` (as many as :func:`rough_token_count` counts)."""
    return _TOKEN.findall(text)


# -- calibration: workloads driven on the virtual clock -------------------------------------------
def decode_step(preset: GpuPreset, batch: int, context: int) -> Iteration:
    """The first iteration in which ``batch`` sequences of ``context`` prompt tokens all decode."""
    engine = Engine(preset)
    for i in range(batch):
        engine.add([f"{i}.{j}" for j in range(context)], ["x"] * 1000)
    while True:
        step = engine.step()
        assert step is not None
        if step.decode == batch:
            return step


@dataclass(frozen=True)
class ActorLoad:
    """Closed-loop ReAct steps: what :func:`actor_load` measured after its warm-up."""

    requests_per_s: float
    iteration_s: float  # mean
    batch: float  # mean sequences an iteration
    context: float  # mean prompt tokens a request
    new_prompt_tokens: float  # mean prompt tokens a request not served from the prefix cache


def actor_load(
    preset: GpuPreset,
    *,
    episodes: int = 128,
    out_tokens: int = 20,
    observation: int = 100,
    shared: int = 1100,
    steps: int = 6,
    requests: int = 4000,
) -> ActorLoad:
    """``episodes`` ReAct episodes always in flight, each asking again the moment its answer
    (``out_tokens``, its stop included) is back: the prompt is a prefix all episodes share
    (``shared`` tokens: instructions, examples), the episode's first observation, then each step's
    answer and an observation (``observation`` tokens each); after ``steps`` requests a new episode
    takes the slot. Measured over ``requests`` answers after as many of warm-up."""
    engine = Engine(preset)
    prefix = [f"s{j}" for j in range(shared)]
    owner: dict[int, tuple[int, list[str], int]] = {}  # rid -> (episode, prompt, step)

    def ask(episode: int, prompt: list[str], step: int) -> None:
        seq = engine.add(prompt, [f"a{episode}.{step}.{j}" for j in range(out_tokens)])
        owner[seq.rid] = (episode, prompt, step)

    def observe(episode: int, step: int) -> list[str]:
        return [f"o{episode}.{step}.{j}" for j in range(observation)]

    for e in range(episodes):
        ask(e, prefix + observe(e, 0), 0)
    fresh = episodes
    done: list[Seq] = []
    measured: list[Iteration] = []
    while len(done) < 2 * requests:
        step = engine.step()
        assert step is not None
        if len(done) >= requests:
            measured.append(step)
        for seq in step.finished:
            episode, prompt, k = owner.pop(seq.rid)
            done.append(seq)
            if k + 1 < steps:
                answer = [f"a{episode}.{k}.{j}" for j in range(out_tokens)]
                ask(episode, prompt + answer + observe(episode, k + 1), k + 1)
            else:
                ask(fresh, prefix + observe(fresh, 0), 0)
                fresh += 1
    answered = [s for step in measured for s in step.finished]
    span = sum(step.duration_s for step in measured)
    return ActorLoad(
        requests_per_s=len(answered) / span,
        iteration_s=span / len(measured),
        batch=sum(step.seqs for step in measured) / len(measured),
        context=sum(s.prompt_len for s in answered) / len(answered),
        new_prompt_tokens=sum(s.prompt_len - (s.cached_tokens or 0) for s in answered)
        / len(answered),
    )


class LiveEngine:
    """An :class:`Engine` in real time: each iteration lasts its simulated time times
    ``time_scale``; :meth:`complete` blocks its thread until its answers are generated,
    :meth:`submit` returns a future of them. ``timeline`` keeps every iteration's wall start,
    end and sequences (``time.monotonic()``)."""

    def __init__(
        self, preset: GpuPreset, *, time_scale: float = 1.0, kv_capacity_tokens: int | None = None
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine = Engine(preset, kv_capacity_tokens=kv_capacity_tokens)
        self.time_scale = time_scale
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[Future[tuple[int, int, int]], list[Seq]]] = {}
        self._stopped = False
        self.timeline: list[tuple[float, float, int]] = []
        self.cpu_s = 0.0  # CPU the simulator's own thread spent (not the GPU's time)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gpu-standin")
        self._thread.start()

    def complete(self, prompt: str, answers: list[str]) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens once every answer to ``prompt`` is generated."""
        return self.submit(prompt, answers).result()

    def submit(self, prompt: str, answers: list[str]) -> Future[tuple[int, int, int]]:
        """:meth:`complete`'s counts, as a future (an error once the engine is stopped)."""
        tokens = tokens_of(prompt)
        future: Future[tuple[int, int, int]] = Future()
        with self._cond:
            if self._stopped:
                future.set_exception(RuntimeError("the GPU stand-in is stopped"))
                return future
            seqs = [self.engine.add(tokens, [*tokens_of(a), "<stop>"]) for a in answers]
            for seq in seqs:
                self._waiting[seq.rid] = (future, seqs)
            self._cond.notify_all()
        return future

    def _settle(self, finished: tuple[Seq, ...]) -> None:
        """Resolve the futures whose every answer is now generated."""
        ready = []
        with self._cond:
            for seq in finished:
                future, seqs = self._waiting.pop(seq.rid)
                if not any(s.rid in self._waiting for s in seqs):
                    ready.append((future, seqs))
        for future, seqs in ready:
            prompt = seqs[0].prompt_len
            future.set_result((prompt, sum(s.out_len for s in seqs), seqs[0].cached_tokens or 0))

    def _loop(self) -> None:
        deadline = time.monotonic()
        while True:
            self.cpu_s = time.thread_time()
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or not self.engine.idle())
                if self._stopped:
                    return
                step = self.engine.step()
            if step is None:
                continue
            began = max(deadline, time.monotonic())
            deadline = began + step.duration_s * self.time_scale
            time.sleep(max(0.0, deadline - time.monotonic()))
            self.timeline.append((began, deadline, step.seqs))
            self._settle(step.finished)

    def stats(self) -> dict[str, Any]:
        """The engine's counts, its busy time in simulated and wall seconds, and the busy
        fraction of the wall time since it started."""
        with self._cond:
            out = self.engine.stats()
        wall = time.monotonic() - self._started
        out.update(
            time_scale=self.time_scale,
            busy_wall_s=out["busy_s"] * self.time_scale,
            wall_s=wall,
            busy_fraction=out["busy_s"] * self.time_scale / wall if wall > 0 else 0.0,
        )
        return out

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            waiting = {id(f): f for f, _ in self._waiting.values()}
            self._waiting.clear()
            self._cond.notify_all()
        for future in waiting.values():
            future.set_exception(RuntimeError("the GPU stand-in was stopped"))
        self._thread.join(timeout=5)


# -- answers from a scripted policy, reading the prompt as a model would --------------------------
_SEEN = re.compile(r"you see (.+?)\.\s*$", re.IGNORECASE | re.MULTILINE)


def site_of(prompt: str) -> CallSite:
    """The call site a ``scripted:`` policy needs, read from an actor prompt's text: the game is
    a hash of its current task's first observation, the history its ``> `` lines after it,
    the admissible commands ``look``, ``inventory`` and a ``go to`` each place the first
    observation names."""
    at = prompt.rfind(TASK_LINE)
    if at < 0:
        return CallSite()
    head = prompt[:at].rstrip()
    first = head[head.rfind("\n\n") + 1 :]  # the paragraph up to the task line
    history = tuple(line[2:].strip() for line in prompt[at:].splitlines() if line.startswith("> "))
    places: list[str] = []
    for seen in _SEEN.findall(first)[-1:]:
        for part in re.split(r",\s*(?:and\s+)?|\s+and\s+", seen):
            place = re.sub(r"^(?:a|an|the)\s+", "", part.strip())
            if place:
                places.append(f"go to {place}")
    game = hashlib.sha256(first.encode()).hexdigest()[:12]
    admissible = ("look", "inventory", *places)
    return CallSite(game=game, step=len(history), history=history, admissible=admissible)


def text_policy(policy: str) -> Callable[[str], str]:
    """The answer of ``scripted:<policy>`` to a prompt, from its text alone (:func:`site_of`)."""
    backend = ScriptedBackend(policy)

    def answer(prompt: str) -> str:
        request = Request(GenerationConfig(max_tokens=256), prompt=prompt, site=site_of(prompt))
        return backend.generate([request])[0].text

    return answer


def standin_server(
    preset: GpuPreset = H100_8B,
    *,
    policy: str = "random",
    time_scale: float = 1.0,
    kv_capacity_tokens: int | None = None,
    port: int = 0,
) -> FaultServer:
    """An OpenAI-compatible server on 127.0.0.1 whose answers come from ``scripted:<policy>``
    and whose timing is a :class:`LiveEngine` (``GET /stats``: its :meth:`LiveEngine.stats`).
    Start it with ``with standin_server(...) as server:``."""
    live = LiveEngine(preset, time_scale=time_scale, kv_capacity_tokens=kv_capacity_tokens)
    return FaultServer(FaultPlan(), answer=text_policy(policy), engine=live, port=port)


class StandinBackend:
    """The stand-in in process, as vLLM's async engine is: an async backend whose answers are a
    scripted policy's (read from the request's call site, as the in-process ``scripted:``
    backend reads it) and whose timing is ``live``'s."""

    def __init__(
        self, live: LiveEngine, policy: str = "random", ground_truth: GroundTruth = NO_GROUND_TRUTH
    ) -> None:
        self.name = f"standin:{policy}"
        self.live = live
        self.policy = ScriptedBackend(policy, ground_truth=ground_truth)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.name, "backend": "standin", "preset": self.live.engine.preset.name}

    async def agenerate(self, request: Request) -> Completion:
        started = time.perf_counter()
        (answer,) = self.policy.generate([request])
        prompt = request.prompt if request.prompt is not None else ""
        if request.messages is not None:
            prompt = "\n".join(m.content for m in request.messages)
        texts = [answer.text, *answer.alternatives]
        counts = await asyncio.wrap_future(self.live.submit(prompt, texts))
        return dataclasses.replace(
            answer,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            cached_tokens=counts[2],
            latency_s=time.perf_counter() - started,
        )

    def generate(self, requests: list[Request]) -> list[Completion]:
        return [asyncio.run(self.agenerate(r)) for r in requests]

    def close(self) -> None:
        self.policy.close()
