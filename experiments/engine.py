"""The episode engine: many episodes in flight on one event loop, no lockstep ticks.

Each episode is an agent coroutine (:mod:`agents.episode`) playing through a context that this
module implements. An episode advances the moment its own model answer or env result is there:

- env calls go to the worker pool at once and come back as each finishes
  (:class:`envs.aio.AsyncEnvPool`); a slow reset holds up only its own episode;
- model requests reach the backend as they come (:class:`ModelClient`): a backend that awaits
  requests (vLLM's async engine, which batches them continuously; the OpenAI-compatible client,
  whose HTTP runs on a loop of its own) gets every request at once and bounds what it has in
  flight itself; another HTTP backend (Anthropic's SDK) gets each request in its own thread, at
  most ``max_in_flight`` at a time; a
  backend that answers at once (``scheduling = "inline"``: the scripted policies) is called on
  the loop itself, as an async engine's submission is; any other backend (llama.cpp,
  transformers) gets everything pending, one batch at a time, the next batch formed from
  whatever arrived meanwhile;
- a request that fails after the backend's retries fails its own episode (an infrastructure
  error, retried on ``--resume``; its traceback is kept in the store's ``episode_errors``) and
  nothing else; a dead env worker's episode is re-simulated from its recorded actions and
  carries on;
- a prompt that outgrew the model's context (:class:`ContextLimitError`) ends its episode as the
  agent's failure, class ``context_limit``, with the prompt's token count in its verdict (never
  retried); a model engine that died and was rebuilt (:class:`ModelRestarted`) has its episodes
  in flight played again from the start, as fresh attempts (at most ``RESTART_RERUNS`` each).

Every step is committed to the run store as the agent records it; every model call is a row of
its own: purpose, call site, the request as the backend sent it (``Completion.sent``, through
:func:`agents.llm.common.sent_request`), the answer, tokens, latency, retries and each failed
attempt's error. The bound of a run is max(model time / concurrency, env
time / workers): ``benchmarks/bench_engine.py`` measures against it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from agents.episode import Agent, EpisodeEnd, EpisodeSpec
from agents.llm.answers import storable
from agents.llm.base import (
    OVERSIZED,
    AsyncBackend,
    Backend,
    BackendError,
    Completion,
    ContextLimitError,
    ModelRestarted,
    Request,
)
from agents.llm.common import sent_request
from envs.aio import AsyncEnvPool
from envs.pool import Reset, WorkerCrashed
from experiments.store import RunStore, Tokens
from memory.records import EnvReply, EpisodeStatus, FailureClass, ModelCall, Step

log = logging.getLogger("reflexsim.engine")

RESTART_RERUNS = 3  # times one episode is played again after its model engine was rebuilt
TRACEBACK_CHARS = 20000  # of an infrastructure error's traceback kept in the store


def traceback_text(exc: BaseException) -> str:
    """``exc``'s whole traceback, its causes included (capped), for the store (storable: a
    cause's message may hold a server's text)."""
    return storable("".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:])[0]


def context_verdict(exc: ContextLimitError) -> str:
    """The verdict of an episode whose prompt outgrew the model's context."""
    tokens = "?" if exc.prompt_tokens is None else exc.prompt_tokens
    limit = "?" if exc.limit is None else exc.limit
    bound = "" if exc.exact else "at least "
    return f"prompt of {bound}{tokens} tokens exceeds the model's context of {limit} tokens"


class StopRun(Exception):
    """A budget or deadline stopped the run: live episodes become 'interrupted' for --resume."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EnvFailure(RuntimeError):
    """The env could not answer (a reset that failed, a worker that died twice)."""


# -- the model ----------------------------------------------------------------------------------
class ModelClient:
    """Requests reach the backend as they come; see the module docstring for the three ways."""

    def __init__(self, backend: Backend, max_in_flight: int = 8) -> None:
        self.backend = backend
        self.max_in_flight = max(1, max_in_flight)
        if isinstance(backend, AsyncBackend):
            self.mode = "async"
        elif getattr(backend, "scheduling", "batch") in ("per_request", "inline"):
            self.mode = backend.scheduling  # type: ignore[attr-defined]
        else:
            self.mode = "batch"
        workers = self.max_in_flight if self.mode == "per_request" else 1
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="reflexsim-model")
        self._pending: deque[tuple[Request, asyncio.Future[Completion]]] = deque()
        self._batch_running = False
        self._batch_task: asyncio.Task[None] | None = None
        self.batches: list[int] = []  # sizes of the batches sent (batch mode)

    async def generate(self, request: Request) -> Completion:
        """One completion; raises BackendError when the request failed after its retries."""
        if self.mode == "async":
            agenerate = self.backend.agenerate  # type: ignore[attr-defined]
            result: Completion = await agenerate(request)
            return result
        if self.mode == "inline":  # answers at once: no thread to hand it to
            (answer,) = self._answer([request])
            if isinstance(answer, BaseException):
                raise answer
            return answer
        loop = asyncio.get_running_loop()
        if self.mode == "per_request":
            answers = await loop.run_in_executor(self._threads, self.backend.generate, [request])
            return answers[0]
        future: asyncio.Future[Completion] = loop.create_future()
        self._pending.append((request, future))
        if not self._batch_running:
            # the task starts after every episode ready in this turn of the loop has added its
            # request, so they form one batch
            self._batch_running = True
            self._batch_task = loop.create_task(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = [(r, f) for r, f in self._pending if not f.done()]
                self._pending.clear()
                if not batch:
                    continue
                self.batches.append(len(batch))
                try:
                    results = await loop.run_in_executor(
                        self._threads, self._answer, [r for r, _ in batch]
                    )
                except BaseException as exc:  # a bug in a backend: every waiter hears of it
                    results = [exc] * len(batch)
                    if not isinstance(exc, Exception):
                        raise
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._batch_running = False

    def _answer(self, requests: list[Request]) -> list[Completion | BaseException]:
        """The batch's answers; when the batch fails, each request alone, so that one bad
        request fails only itself. Never raises a BackendError: it is each request's answer."""
        try:
            return list(self.backend.generate(requests))
        except BackendError as exc:
            if len(requests) == 1:
                return [exc]
        out: list[Completion | BaseException] = []
        for request in requests:
            try:
                out.append(self.backend.generate([request])[0])
            except BackendError as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


# -- budgets ------------------------------------------------------------------------------------
# Tokens used by the run so far (the store's totals at start, plus every call since): what the
# budget check reads.
Usage = Tokens


# -- one episode ------------------------------------------------------------------------------------
class _Context:
    """The context an agent plays one episode through (agents.episode.EpisodeContext)."""

    def __init__(
        self, engine: Engine, spec: EpisodeSpec, slot: int, model: ModelClient | None = None
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.slot = slot
        self.model = model  # this episode's actor, when it is not the engine's
        self.started = spec.resumed  # its row exists already
        self.resets = 0
        self.admitted = False  # holds one of the engine's places among the episodes that play

    # -- env ------------------------------------------------------------------------------------
    async def reset(self, replay: Sequence[str] = ()) -> EnvReply:
        self.engine.check_stop()
        call = Reset(self.spec.game, None, tuple(replay))
        outcome = await self.engine.envs.call(self.slot, call)
        if isinstance(outcome, WorkerCrashed):  # a fresh worker gets one more try
            outcome = await self.engine.envs.call(self.slot, call)
        if isinstance(outcome, Exception):
            raise EnvFailure(f"reset failed: {type(outcome).__name__}: {outcome}")
        store = self.engine.store
        if not self.started:
            if self.spec.prefix_for is not None:  # the prompt depends on the task: finish it
                prefix, shown = self.spec.prefix_for(outcome.observation)
                self.spec = replace(self.spec, prefix=prefix, experience=shown, prefix_for=None)
            self._begin(outcome.observation, str(outcome.info.get("task", "")))
        elif self.spec.resumed and self.resets == 0:
            store.mark_resimulated(self.spec.episode_id)
            store.log_event(
                "resume",
                f"re-simulated {len(self.spec.resume_steps)} recorded steps",
                self.spec.episode_id,
            )
        self.resets += 1
        await self._admit()  # reset ahead of its turn: now wait for a place to play in
        return outcome

    async def _admit(self) -> None:
        if not self.admitted:
            await self.engine.admit()
            self.admitted = True

    def _begin(self, observation: str, task: str) -> None:
        spec = self.spec
        self.engine.store.start_episode(
            episode_id=spec.episode_id,
            game=spec.game,
            task_type=spec.task_type,
            trial=spec.trial,
            arm=self.engine.arm,
            prompt_prefix=spec.prefix,
            observation=observation,
            task=task,
            memory=spec.memory,
            seed=spec.seed,
            experience=spec.experience.to_json() if spec.experience is not None else None,
        )
        self.started = True

    async def step(self, action: str) -> EnvReply:
        self.engine.check_stop()
        envs = self.engine.envs
        outcome = await envs.call(self.slot, action)
        if isinstance(outcome, WorkerCrashed):
            # re-simulate the episode on a fresh worker, then retry the action in flight
            store = self.engine.store
            store.log_event("worker_crash", outcome.reason, self.spec.episode_id)
            replayed = await envs.call(self.slot, Reset(self.spec.game, None, outcome.actions))
            if isinstance(replayed, Exception):
                raise EnvFailure(f"env error: {type(replayed).__name__}: {replayed}")
            store.mark_resimulated(self.spec.episode_id)
            outcome = await envs.call(self.slot, action)
        if isinstance(outcome, Exception):
            raise EnvFailure(f"env error: {type(outcome).__name__}: {outcome}")
        return outcome

    # -- model ----------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Completion:
        await self._admit()
        return await self.engine.generate(
            request, self.spec.game, self.spec.trial, self.spec.episode_id, actor=self.model
        )

    def record(self, step: Step) -> None:
        self.engine.store.add_step(self.spec.episode_id, step)
        self.engine.on_step(self.spec)

    def fail(self, error: str, exc: BaseException) -> None:
        """End the episode as an infrastructure error (its row is made if it has none); ``exc``'s
        traceback is kept with the attempt."""
        if not self.started:
            self._begin("", "")
        log.warning("episode %s: %s", self.spec.episode_id, error)
        store = self.engine.store
        store.add_episode_error(self.spec.episode_id, "infra_error", error, traceback_text(exc))
        store.finish_episode(
            self.spec.episode_id,
            status=EpisodeStatus.ERROR.value,
            won=False,
            failure_class=FailureClass.INFRA_ERROR.value,
            error=error[:2000],
        )

    def again(self, exc: ModelRestarted) -> None:
        """The model engine died under this attempt: keep why, and play the episode again."""
        store, episode = self.engine.store, self.spec.episode_id
        log.warning("episode %s: %s; played again from the start", episode, exc)
        store.log_event("engine_restart", str(exc), episode)
        if self.started:
            store.add_episode_error(episode, "engine_restart", str(exc), traceback_text(exc))
            store.retry_episode(episode)


class Engine:
    """Plays ``concurrency`` episodes at a time and records everything.

    The env pool may have more slots than that: an episode waiting for its turn takes a spare
    slot and resets its game there (a reset is the costly env call: a game is loaded), then
    waits for a place among the ``concurrency`` that play; so resets overlap the model time of
    the episodes in play instead of coming after it, and at most ``concurrency`` episodes ever
    send model requests."""

    def __init__(
        self,
        store: RunStore,
        model: ModelClient,
        envs: AsyncEnvPool,
        *,
        arm: str,
        reflector: ModelClient | None = None,
        routes: Mapping[str, ModelClient] | None = None,
        should_stop: Callable[[Usage], str | None] = lambda usage: None,
        on_episode_done: Callable[[EpisodeSpec, EpisodeEnd | None], None] = lambda s, e: None,
        on_step: Callable[[EpisodeSpec], None] = lambda s: None,
        concurrency: int | None = None,
    ) -> None:
        self.store = store
        self.model = model
        self.reflector = reflector or model
        self.routes = dict(routes or {})  # purpose -> an arm role's own model (else the actor)
        self.envs = envs
        self.arm = arm
        self.should_stop = should_stop
        self.on_episode_done = on_episode_done
        self.on_step = on_step  # a step was recorded
        self.usage = store.token_totals()
        self._free: asyncio.Queue[int] | None = None
        self.concurrency = min(concurrency or envs.slots, envs.slots)
        self._places: asyncio.Semaphore | None = None
        self.stopped: str | None = None

    async def admit(self) -> None:
        """Wait for a place among the episodes in play (first come, first served)."""
        if self._places is None:
            self._places = asyncio.Semaphore(self.concurrency)
        await self._places.acquire()

    def check_stop(self) -> None:
        if self.stopped is None:
            self.stopped = self.should_stop(self.usage)
        if self.stopped is not None:
            raise StopRun(self.stopped)

    async def generate(
        self,
        request: Request,
        game: str,
        trial: int,
        episode_id: str | None = None,
        actor: ModelClient | None = None,
    ) -> Completion:
        """A model call on behalf of an episode (or of a task: reflect, judge), recorded.
        Reflect and judge calls go to the reflector, a purpose the arm routes to a role of its
        own to that role's model, the rest to the actor (``actor``: an episode's own, e.g. an
        escalation run's)."""
        self.check_stop()
        started = time.perf_counter()
        actor = actor or self.model
        if request.purpose in ("reflect", "judge"):
            client = self.reflector
        elif request.purpose in self.routes:
            client = self.routes[request.purpose]
        else:
            client = actor
        try:
            completion = await client.generate(request)
        except BackendError as exc:
            self.store.add_model_call(
                ModelCall(
                    purpose=request.purpose, game=game, trial=trial, episode_id=episode_id,
                    latency_s=time.perf_counter() - started, retries=exc.retries,
                    error=str(exc)[:2000], step=request.site.step,
                    sent=sent_request(request, None), attempt_errors=exc.attempt_errors,
                )
            )  # fmt: skip
            if exc.retries:
                self.store.log_event("retry", f"{exc.retries} retries", episode_id)
            if not isinstance(exc, ContextLimitError | ModelRestarted):  # they log their own
                self.store.log_event("infra_error", f"{type(exc).__name__}: {exc}", episode_id)
            raise
        self.usage += Tokens(
            completion.prompt_tokens, completion.completion_tokens, completion.cached_tokens
        )
        self.store.add_model_call(
            ModelCall(
                purpose=request.purpose, game=game, trial=trial, episode_id=episode_id,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                cached_tokens=completion.cached_tokens, latency_s=completion.latency_s,
                retries=completion.retries, step=request.site.step,
                sent=sent_request(request, completion.sent), answer=completion.text,
                alternatives=completion.alternatives, finish_reason=completion.finish_reason,
                attempt_errors=completion.attempt_errors,
            )
        )  # fmt: skip
        if completion.retries:
            self.store.log_event("retry", f"{completion.retries} retries", episode_id)
        if completion.finish_reason == OVERSIZED:
            self.store.log_event(
                "oversized",
                f"the server sent more text than max_tokens={request.config.max_tokens} allows "
                f"({request.purpose} call); cut to {len(completion.text)} characters",
                episode_id,
            )
        if completion.invalid_text:
            self.store.log_event(
                "invalid_text",
                f"the answer held {completion.invalid_text} code point(s) that cannot be stored "
                f"(lone surrogates; {request.purpose} call); replaced by U+FFFD",
                episode_id,
            )
        return completion

    async def play(
        self, spec: EpisodeSpec, agent: Agent, model: ModelClient | None = None
    ) -> EpisodeEnd | None:
        """Play one episode in a free slot (``model``: its actor, when not the engine's); its
        end, or None when the harness failed it."""
        if self._free is None:
            self._free = asyncio.Queue()
            for slot in range(self.envs.slots):
                self._free.put_nowait(slot)
        self.check_stop()
        slot = await self._free.get()
        try:
            for attempt in range(RESTART_RERUNS + 1):
                episode = _Context(self, spec, slot, model)
                episode.started = episode.started or attempt > 0
                try:
                    return await self._attempt(episode, agent, last=attempt == RESTART_RERUNS)
                except ModelRestarted as exc:
                    episode.again(exc)
                    spec = dataclasses.replace(spec, resume_steps=(), resumed_observation=None)
                finally:
                    if episode.admitted:
                        assert self._places is not None
                        self._places.release()
            raise AssertionError("unreachable: the last attempt fails as an infrastructure error")
        finally:
            self._free.put_nowait(slot)

    async def _attempt(self, episode: _Context, agent: Agent, last: bool) -> EpisodeEnd | None:
        """One attempt at an episode: its end; None when the harness failed it; raises
        ModelRestarted when it is to be played again (never on the ``last`` attempt)."""
        spec = episode.spec
        try:
            end = await agent.play(episode)
        except ModelRestarted as exc:
            if not last:
                raise
            episode.fail(f"backend: {exc} (played {RESTART_RERUNS + 1} times)", exc)
            self.on_episode_done(spec, None)
            return None
        except ContextLimitError as exc:
            end = EpisodeEnd(False, FailureClass.CONTEXT_LIMIT.value, context_verdict(exc))
            self.store.log_event("context_limit", f"{end.verdict}: {exc}", spec.episode_id)
        except (BackendError, EnvFailure) as exc:
            prefix = "backend: " if isinstance(exc, BackendError) else ""
            episode.fail(f"{prefix}{exc}", exc)
            self.on_episode_done(spec, None)
            return None
        self.store.finish_episode(
            spec.episode_id,
            status=EpisodeStatus.DONE.value,
            won=end.won,
            failure_class=end.failure_class,
            verdict=end.verdict,
        )
        self.on_episode_done(spec, end)
        return end
