"""The trial loop of Reflexion: every task advances through its own trials.

Trial k of a task runs only if the task is unsolved after trials 0..k-1; success at trial k is
cumulative. A task's trial k+1 needs only its own trial k (and that trial's reflection), so each
task is a chain of its own: play, judge (LLM evaluator arm), reflect, play again. No task waits
for another's trial to end, so the engine stays busy until the last task is done. This module
only plans and saves: the agents play, judge and reflect (``agents/``), the engine runs them.
Everything is read back from the run store, so a resumed run picks up exactly where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents import reflexion
from agents.episode import Agent, EpisodeSpec, episode_seed
from agents.llm.base import BackendError, Completion, Request
from agents.reflexion import ReflexionSettings
from experiments.engine import Engine, StopRun
from experiments.store import EpisodeRow, RunStore, episode_id
from memory.records import EpisodeStatus, Reflection

log = logging.getLogger("reflexsim.trials")


@dataclass(frozen=True)
class Task:
    game: str
    task_type: str


@dataclass(frozen=True)
class TrialPlan:
    """What the trial loop needs beyond the agent: how many trials, and the arm's settings."""

    trials: int
    reflexion: ReflexionSettings
    llm_judge: bool = False  # the LLM evaluator arm: judge every finished episode


class _TaskHalted(Exception):
    """A task cannot go on in this run (a harness failure); --resume continues it."""


class TrialLoop:
    """Runs every task's chain of trials on one engine; see the module docstring."""

    def __init__(
        self,
        store: RunStore,
        engine: Engine,
        agent: Agent,
        plan: TrialPlan,
        on_task_done: Callable[[Task, bool, int], None] = lambda task, won, trial: None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.agent = agent
        self.plan = plan
        self.on_task_done = on_task_done
        self._at: dict[str, float] = {}  # each task's current trial (inf when done)
        self._open_trials: set[int] = set()

    async def run(self, tasks: Sequence[Task]) -> str | None:
        """All tasks' trials; None when complete, or why the run stopped early."""
        for t in tasks:
            self._at[t.game] = 0
        chains = [asyncio.ensure_future(self._chain(t)) for t in tasks]
        try:
            done = await asyncio.gather(*chains, return_exceptions=True)
        finally:
            for c in chains:
                c.cancel()
        stops = [d for d in done if isinstance(d, StopRun)]
        for d in done:
            if isinstance(d, BaseException) and not isinstance(d, StopRun | _TaskHalted):
                raise d
        return stops[0].reason if stops else None

    # -- one task ---------------------------------------------------------------------------------
    async def _chain(self, task: Task) -> None:
        try:
            await self._trials(task)
        except StopRun:
            self._stop_all()
            raise
        finally:
            self._advance(task, float("inf"))

    def _stop_all(self) -> None:
        # the first stop wins; every other chain sees it at its next call
        if self.engine.stopped is None:
            self.engine.stopped = "stopped"

    async def _trials(self, task: Task) -> None:
        store = self.store
        for trial in range(self.plan.trials):
            self._advance(task, trial)
            row = store.episode(episode_id(task.game, trial))
            if row is not None and row.status == EpisodeStatus.DONE.value:
                if row.won:
                    self.on_task_done(task, True, trial)
                    return
                await self._after_episode(task, trial, row)
                continue
            if row is not None and row.status == EpisodeStatus.ERROR.value:
                store.retry_episode(row.episode_id)  # the harness failed, not the agent
                row = store.episode(row.episode_id)
            store.join_trial(trial, task.game)
            spec = self._resumed(row) if row is not None else self._new(task, trial)
            end = await self.engine.play(spec, self.agent)
            if end is None:
                raise _TaskHalted(f"{task.game} trial {trial}: infrastructure error")
            row = store.episode(spec.episode_id)
            assert row is not None
            if end.won:
                await self._judge(task, trial, row)
                self.on_task_done(task, True, trial)
                return
            await self._after_episode(task, trial, row)
        self.on_task_done(task, False, self.plan.trials - 1)

    def _new(self, task: Task, trial: int) -> EpisodeSpec:
        settings = self.plan.reflexion
        reflections: list[Reflection] = []
        if settings.uses_memory:
            reflections = reflexion.visible_reflections(
                self.store.reflections(task.game), task.game, trial, settings.memory_size
            )
        facts = []
        if settings.arm == "reflexion+explore":
            earlier = [
                (e.trial, self.store.steps(e.episode_id))
                for e in self.store.episodes()
                if e.game == task.game and e.trial < trial
            ]
            facts = reflexion.exploration_facts(earlier, task.game)
        return EpisodeSpec(
            episode_id=episode_id(task.game, trial),
            game=task.game,
            task_type=task.task_type,
            trial=trial,
            prefix=reflexion.prompt_prefix(settings, task.task_type, reflections, facts),
            memory=tuple(reflections),
            seed=episode_seed(settings.seed or 0, task.game, trial),
        )

    def _resumed(self, row: EpisodeRow) -> EpisodeSpec:
        """An interrupted episode: same prompt as recorded, continued from its next step."""
        return EpisodeSpec(
            episode_id=row.episode_id,
            game=row.game,
            task_type=row.task_type,
            trial=row.trial,
            prefix=row.prompt_prefix,
            memory=tuple(Reflection.from_dict(r) for r in json.loads(row.memory_json)),
            seed=row.seed if row.seed is not None else self.plan.reflexion.seed,
            resume_steps=tuple(self.store.steps(row.episode_id)),
            resumed_observation=row.observation,
        )

    # -- between trials ---------------------------------------------------------------------------
    async def _after_episode(self, task: Task, trial: int, row: EpisodeRow) -> None:
        """Judge (LLM evaluator arm) and reflect on a failed episode, unless already done."""
        row = await self._judge(task, trial, row)
        settings = self.plan.reflexion
        if not settings.uses_memory or trial >= self.plan.trials - 1:
            return  # a reflection after the last trial would never be read
        if self.plan.llm_judge and row.judge_verdict == "success":
            return  # the self-evaluation arm reflects only when its judge saw a failure
        if any(r.trial == trial for r in self.store.reflections(task.game)):
            return
        try:
            reflection, prompt_tokens, completion_tokens = await reflexion.reflect(
                _TaskModel(self.engine, task.game, trial),
                settings,
                task=task.game,
                trial=trial,
                episode_id=row.episode_id,
                observation=row.observation,
                steps=self.store.steps(row.episode_id),
            )
        except BackendError as exc:
            raise _TaskHalted(f"{task.game} trial {trial}: reflection failed: {exc}") from exc
        self.store.add_reflection(reflection, prompt_tokens, completion_tokens)

    async def _judge(self, task: Task, trial: int, row: EpisodeRow) -> EpisodeRow:
        if not self.plan.llm_judge or row.judge_verdict is not None:
            return row
        try:
            verdict, reason = await reflexion.judge(
                _TaskModel(self.engine, task.game, trial),
                task=task.game,
                trial=trial,
                observation=row.observation,
                steps=self.store.steps(row.episode_id),
                seed=self.plan.reflexion.seed,
            )
        except BackendError as exc:
            raise _TaskHalted(f"{task.game} trial {trial}: judge failed: {exc}") from exc
        self.store.set_judge(row.episode_id, verdict, reason)
        fresh = self.store.episode(row.episode_id)
        assert fresh is not None
        return fresh

    # -- trial bookkeeping ------------------------------------------------------------------------
    def _advance(self, task: Task, trial: float) -> None:
        """Task ``task`` is now at ``trial``; close every trial no task can still join."""
        self._at[task.game] = trial
        if trial != float("inf"):
            self._open_trials.add(int(trial))
        if self.engine.stopped is not None:
            return
        lowest = min(self._at.values(), default=float("inf"))
        for k in sorted(self._open_trials):
            if k < lowest:
                self.store.finish_trial(k)
                self._open_trials.discard(k)


class _TaskModel:
    """Model access for a task's calls between episodes (reflect, judge), recorded as such."""

    def __init__(self, engine: Engine, game: str, trial: int) -> None:
        self.engine = engine
        self.game = game
        self.trial = trial

    async def generate(self, request: Request) -> Completion:
        return await self.engine.generate(request, self.game, self.trial)
