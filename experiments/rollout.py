"""The rollout loop: many episodes in flight, one batched model call per tick.

Each tick: start episodes in free slots, ask the model for the next step of every live episode
at once, step every env that got an action (concurrently, in the worker pool), commit each step
to the run store, and retire finished episodes. Read it top to bottom; nothing else drives an
episode.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.evaluators import Evaluator, Verdict, classify_failure, count_actions
from agents.llm.base import Backend, BackendError, Completion, GenerationConfig, Request
from agents.parsing import GroundingRules, ParsedAction, parse_action
from agents.prompting import actor_prompt
from envs.pool import Reset, StepResult, WorkerCrashed
from experiments.store import RunStore
from memory.records import EpisodeStatus, FailureClass, Reflection, Step, StepKind

log = logging.getLogger("reflexsim.rollout")

NOTHING_HAPPENS = "Nothing happens."
THOUGHT_OBSERVATION = "OK."


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to play: a task in a trial, with the fixed part of its prompt."""

    episode_id: str
    game: str
    task_type: str
    trial: int
    prefix: str  # instruction + examples + memory block
    memory: tuple[Reflection, ...] = ()
    resume_steps: tuple[Step, ...] = ()  # recorded steps of an interrupted episode
    resumed: bool = False  # the episode's row exists already: continue it, don't start it


@dataclass(frozen=True)
class RolloutSettings:
    arm: str
    generation: GenerationConfig
    evaluator: Evaluator
    grounding: GroundingRules
    max_steps: int
    count_thoughts: bool = True


@dataclass
class _Live:
    job: EpisodeJob
    slot: int
    observation: str = ""
    task: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    @property
    def history(self) -> list[tuple[str, str]]:
        return [(s.action or s.raw_output.strip(), s.observation) for s in self.steps]

    def prompt(self) -> str:
        return actor_prompt(self.job.prefix, self.observation, self.history)


class Rollout:
    """Plays episode jobs to the end (or until ``should_stop`` says so), committing every step."""

    def __init__(
        self,
        backend: Backend,
        pool: Any,
        store: RunStore,
        settings: RolloutSettings,
        should_stop: Callable[[], str | None] = lambda: None,
        on_episode_done: Callable[[str, bool], None] = lambda episode, won: None,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.store = store
        self.settings = settings
        self.should_stop = should_stop
        self.on_episode_done = on_episode_done
        self.tokens = 0
        self._finished_ids: set[str] = set()

    def run(self, jobs: Sequence[EpisodeJob]) -> str | None:
        """Play all jobs; returns None when done, or the reason it stopped early."""
        queue = deque(jobs)
        live: dict[int, _Live] = {}
        free = deque(range(self.pool.slots))
        while queue or live:
            stop = self.should_stop()
            if stop:
                return stop  # live episodes stay 'running' in the store: --resume continues them
            self._start(queue, free, live)
            if not live:
                continue
            episodes = list(live.values())
            completions = self._ask_model(episodes)
            if completions is None:
                for ep in episodes:
                    self._retire(ep, live, free)
                continue
            actions: dict[int, tuple[ParsedAction, Completion]] = {}
            for ep, completion in zip(episodes, completions, strict=True):
                parsed = parse_action(completion.text, self.settings.grounding)
                if parsed.kind == StepKind.ACT:
                    actions[ep.slot] = (parsed, completion)
                else:
                    obs = THOUGHT_OBSERVATION if parsed.kind == StepKind.THINK else NOTHING_HAPPENS
                    self._record(
                        ep, parsed, completion, obs, admissible=parsed.kind == StepKind.THINK
                    )
            outcomes = self.pool.step_many({slot: p.action for slot, (p, _) in actions.items()})
            for slot, (parsed, completion) in actions.items():
                ep = live[slot]
                outcome = outcomes[slot]
                if isinstance(outcome, WorkerCrashed):
                    outcome = self._recover(ep, outcome, parsed.action)
                if isinstance(outcome, Exception):
                    self._finish_error(ep, f"env error: {outcome.__class__.__name__}: {outcome}")
                    continue
                admissible = parsed.action in ep.info.get("admissible_commands", ())
                ep.info = outcome.info
                self._record(ep, parsed, completion, outcome.observation, admissible, outcome)
            for ep in episodes:
                if ep.job.episode_id not in self._finished_ids:
                    self._check_end(ep)
            for ep in episodes:
                if ep.job.episode_id in self._finished_ids:
                    self._retire(ep, live, free)
        return None

    # -- starting ----------------------------------------------------------------------------
    def _start(self, queue: deque[EpisodeJob], free: deque[int], live: dict[int, _Live]) -> None:
        starting: dict[int, EpisodeJob] = {}
        while queue and free:
            starting[free.popleft()] = queue.popleft()
        if not starting:
            return
        resets = {
            slot: Reset(
                job.game, None, tuple(s.action for s in job.resume_steps if s.kind == StepKind.ACT)
            )
            for slot, job in starting.items()
        }
        outcomes = self.pool.reset_many(resets)
        for slot, job in starting.items():
            outcome = outcomes[slot]
            if isinstance(outcome, WorkerCrashed):  # a fresh worker gets one more try
                outcome = self.pool.reset_many({slot: resets[slot]})[slot]
            ep = _Live(job, slot)
            if isinstance(outcome, Exception):
                self._begin(ep, "", "")
                self._finish_error(ep, f"reset failed: {outcome.__class__.__name__}: {outcome}")
                free.append(slot)
                continue
            first_obs = self._first_observation(job, outcome)
            ep.info = outcome.info
            self._begin(ep, first_obs, str(outcome.info.get("task", "")))
            if job.resumed:
                # killed after its last step was committed but before the episode was closed
                ep.info["_last_truncated"] = outcome.truncated
                self._check_end(ep)
                if job.episode_id in self._finished_ids:
                    free.append(slot)
                    continue
            live[slot] = ep

    def _first_observation(self, job: EpisodeJob, outcome: StepResult) -> str:
        if not job.resumed:
            return outcome.observation
        row = self.store.episode(job.episode_id)
        return row.observation if row else outcome.observation

    def _begin(self, ep: _Live, observation: str, task: str) -> None:
        ep.observation = observation
        ep.task = task
        if ep.job.resumed:
            ep.steps = list(ep.job.resume_steps)
            self.store.mark_resimulated(ep.job.episode_id)
            self.store.log_event(
                "resume", f"re-simulated {len(ep.steps)} recorded steps", ep.job.episode_id
            )
            return
        self.store.start_episode(
            episode_id=ep.job.episode_id,
            game=ep.job.game,
            task_type=ep.job.task_type,
            trial=ep.job.trial,
            arm=self.settings.arm,
            prompt_prefix=ep.job.prefix,
            observation=observation,
            task=task,
            memory=ep.job.memory,
        )

    # -- the model -----------------------------------------------------------------------------
    def _ask_model(self, episodes: list[_Live]) -> list[Completion] | None:
        requests = [
            Request(
                config=self.settings.generation,
                prompt=ep.prompt(),
                purpose="act",
                side={
                    "game": ep.job.game,
                    "trial": ep.job.trial,
                    "step": len(ep.steps),
                    "walkthrough": ep.info.get("walkthrough"),
                    "admissible": list(ep.info.get("admissible_commands", ())),
                    "history": [a for a, _ in ep.history],
                },
            )
            for ep in episodes
        ]
        try:
            completions = self.backend.generate(requests)
        except BackendError as exc:
            for ep in episodes:
                self.store.log_event(
                    "infra_error", f"{exc.__class__.__name__}: {exc}", ep.job.episode_id
                )
                self._finish_error(ep, f"backend: {exc}")
            return None
        for c in completions:
            self.tokens += c.prompt_tokens + c.completion_tokens
            if c.retries:
                self.store.log_event("retry", f"{c.retries} retries")
        return completions

    # -- the env -------------------------------------------------------------------------------
    def _recover(self, ep: _Live, crash: WorkerCrashed, action: str) -> StepResult | Exception:
        """Re-simulate an episode whose worker died, then retry the action that was in flight."""
        self.store.log_event("worker_crash", crash.reason, ep.job.episode_id)
        done = tuple(s.action for s in ep.steps if s.kind == StepKind.ACT)
        try:
            self.pool.reset(ep.slot, ep.job.game, replay=done)
            self.store.mark_resimulated(ep.job.episode_id)
            return self.pool.step(ep.slot, action)
        except Exception as exc:  # a second crash: give the episode up as interrupted
            return exc

    # -- recording -----------------------------------------------------------------------------
    def _record(
        self,
        ep: _Live,
        parsed: ParsedAction,
        completion: Completion,
        observation: str,
        admissible: bool,
        outcome: StepResult | None = None,
    ) -> None:
        step = Step(
            index=len(ep.steps),
            kind=parsed.kind.value,
            raw_output=completion.text,
            action=parsed.action,
            observation=observation,
            admissible=admissible,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            cached_tokens=completion.cached_tokens,
            latency_s=completion.latency_s,
            reward=outcome.reward if outcome else 0.0,
            won=bool(outcome and outcome.terminated and outcome.info.get("won")),
        )
        ep.steps.append(step)
        self.store.add_step(ep.job.episode_id, step)
        ep.info["_last_truncated"] = bool(outcome and outcome.truncated)

    def _check_end(self, ep: _Live) -> None:
        if not ep.steps:
            return
        last = ep.steps[-1]
        if last.won:
            self._finish(ep, won=True)
            return
        verdict: Verdict | None = self.settings.evaluator.check(ep.steps)
        truncated = bool(ep.info.get("_last_truncated")) or (
            count_actions(ep.steps, self.settings.count_thoughts) >= self.settings.max_steps
        )
        if verdict is not None or truncated:
            self._finish(ep, won=False, verdict=verdict, truncated=truncated)

    def _finish(
        self, ep: _Live, won: bool, verdict: Verdict | None = None, truncated: bool = False
    ) -> None:
        failure = None if won else classify_failure(ep.steps, verdict, truncated)
        self.store.finish_episode(
            ep.job.episode_id,
            status=EpisodeStatus.DONE.value,
            won=won,
            failure_class=failure,
            verdict=verdict.reason if verdict else ("step cap" if truncated and not won else None),
        )
        self._finished_ids.add(ep.job.episode_id)
        self.on_episode_done(ep.job.episode_id, won)

    def _finish_error(self, ep: _Live, error: str) -> None:
        log.warning("episode %s: %s", ep.job.episode_id, error)
        self.store.finish_episode(
            ep.job.episode_id,
            status=EpisodeStatus.ERROR.value,
            won=False,
            failure_class=FailureClass.INFRA_ERROR.value,
            error=error[:2000],
        )
        self._finished_ids.add(ep.job.episode_id)
        self.on_episode_done(ep.job.episode_id, False)

    def _retire(self, ep: _Live, live: dict[int, _Live], free: deque[int]) -> None:
        if live.pop(ep.slot, None) is not None:
            free.append(ep.slot)
