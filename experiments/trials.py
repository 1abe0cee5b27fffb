"""The trial loop of Reflexion: every task advances through its own trials.

Trial k of a task runs only if the task is unsolved after trials 0..k-1; success at trial k is
cumulative. A task's trial k+1 needs only its own trial k (and that trial's reflection), so each
task is a chain of its own: play, judge (LLM evaluator arm), reflect, play again. No task waits
for another's trial to end, so the engine stays busy until the last task is done. This module
only plans and saves: the agents play, judge and reflect (``agents/``), the engine runs them.
Everything is read back from the run store, so a resumed run picks up exactly where it stopped.

Safeguards (:class:`Safeguards`, all recorded): a task stops being retried when it used up its
token or wall-time budget (checked after each failed episode; a ``task_budget`` event), or
when its trial-k actions repeat an earlier trial's exactly (failure class ``oscillating``; an
``oscillation`` event). A task still unsolved after its last trial (or stopped as oscillating)
is re-run once with the escalation model; that run is kept out of the trials (the store's
``escalations``), so the main curve is unchanged and the report shows it apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents import reflexion
from agents import reflexion_code as code
from agents.episode import Agent, EpisodeSpec, episode_seed
from agents.experience import Experience, Retrieved, Shown
from agents.llm.base import BackendError, Completion, ContextLimitError, ModelRestarted, Request
from agents.memory_policy import NO_MEMORY, Failed, MemoryPolicy
from agents.reflexion import ReflexionSettings
from experiments.engine import RESTART_RERUNS, Engine, ModelClient, StopRun, context_verdict
from experiments.store import EpisodeRow, RunStore, TaskEnd, episode_id, escalation_id
from memory.records import EpisodeStatus, FailureClass, Reflection, Step, env_actions

log = logging.getLogger("reflexsim.trials")
NOT_REFLECTED = "reflection not made"  # how a context_limit event of a refused reflection starts


@dataclass(frozen=True)
class Task:
    game: str
    task_type: str


@dataclass(frozen=True)
class Safeguards:
    """When a task stops being retried, and the escalation run of unsolved tasks."""

    task_max_tokens: int | None = None  # tokens per task across its trials
    task_max_seconds: float | None = None  # wall time per task across its trials
    oscillation_stop: bool = False  # stop a task whose trial repeats an earlier trial's actions
    escalate_model: str | None = None  # re-run unsolved tasks once with this model


@dataclass(frozen=True)
class Escalation:
    """The escalation run's model: its spec (recorded) and the client that serves it."""

    model: str
    client: ModelClient


@dataclass(frozen=True)
class TrialPlan:
    """What the trial loop needs beyond the agent: how many trials, the arm's memory between
    trials and how it reflects."""

    trials: int
    reflexion: ReflexionSettings
    memory: MemoryPolicy = NO_MEMORY
    llm_judge: bool = False  # the LLM evaluator arm: judge every finished episode
    safeguards: Safeguards = Safeguards()
    experience: Experience | None = None  # other tasks' experience (agents.experience)


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
        escalation: Escalation | None = None,
        whole_run: bool = True,
    ) -> None:
        """``whole_run``: False where the loop plays only some of the run's tasks; their owner
        then forgets an earlier pass's task ends and closes the trials."""
        self.store = store
        self.engine = engine
        self.agent = agent
        self.plan = plan
        self.on_task_done = on_task_done
        self.escalation = escalation
        self.whole_run = whole_run
        self._at: dict[str, float] = {}  # each task's current trial (inf when done)
        self._tasks: list[Task] = []
        self._moved = asyncio.Event()  # a task finished an episode or moved on
        self._open_trials: set[int] = set()

    async def run(self, tasks: Sequence[Task]) -> str | None:
        """All tasks' trials; None when complete, or why the run stopped early. Each task that
        ends records why (``task_ends``), so the store says whether the run is complete."""
        if self.whole_run:
            self.store.reopen_tasks()
        self._tasks = list(tasks)
        for t in tasks:
            self._at[t.game] = 0
        chains = [asyncio.ensure_future(self._chain(t)) for t in tasks]
        try:
            done = await asyncio.gather(*chains, return_exceptions=True)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): every chain ends before the store
            if self.engine.stopped is None:
                self.engine.stopped = "interrupted"  # no trial is closed on the way out
            for c in chains:
                c.cancel()
            if chains:
                await asyncio.wait(chains)
            raise
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
            if row is None or row.status != EpisodeStatus.DONE.value:
                row = await self._play(task, trial, row)
            if row.won:
                await self._judge(task, trial, row)  # at once, or after an interrupt
                self._ended(task, True, trial, TaskEnd.SOLVED)
                return
            stop = self._stop(task, trial, row)
            if stop is not None:
                if stop == FailureClass.OSCILLATING.value:
                    await self._escalate(task)
                    self._ended(task, False, trial, TaskEnd.OSCILLATING)
                else:
                    self._ended(task, False, trial, TaskEnd.TASK_BUDGET)
                return
            await self._after_episode(task, trial, row)
        await self._escalate(task)
        self._ended(task, False, self.plan.trials - 1, TaskEnd.TRIALS)

    def _ended(self, task: Task, won: bool, trial: int, reason: TaskEnd) -> None:
        """``task`` has no trial left: recorded as it happens (the run's completeness)."""
        self.store.end_task(task.game, trial, reason.value)
        self.on_task_done(task, won, trial)

    async def _play(
        self, task: Task, trial: int, row: EpisodeRow | None, escalate: Escalation | None = None
    ) -> EpisodeRow:
        """Play (or continue) one episode of ``task``; its finished row."""
        store = self.store
        if row is not None and row.status == EpisodeStatus.ERROR.value:
            store.retry_episode(row.episode_id)  # the harness failed, not the agent
            row = store.episode(row.episode_id)
        elif row is not None and row.status == EpisodeStatus.INTERRUPTED.value:
            store.continue_episode(row.episode_id)
        if escalate is None:
            store.join_trial(trial, task.game)
        spec = self._resumed(row) if row is not None else self._new(task, trial, escalate)
        end = await self.engine.play(
            spec, self.agent, model=escalate.client if escalate is not None else None
        )
        if end is None:
            raise _TaskHalted(f"{task.game} trial {trial}: infrastructure error")
        done = store.episode(spec.episode_id)
        assert done is not None
        self._moved.set()
        return done

    def _stop(self, task: Task, trial: int, row: EpisodeRow) -> str | None:
        """Why a task whose trial ``trial`` failed is not retried: ``oscillating``, ``budget``;
        None to go on. Each stop is recorded once (resume finds it again)."""
        store, guards = self.store, self.plan.safeguards
        if row.failure_class == FailureClass.OSCILLATING:
            return FailureClass.OSCILLATING.value
        if guards.oscillation_stop and trial > 0:
            actions = env_actions(store.steps(row.episode_id))
            for earlier in range(trial):
                if env_actions(store.steps(episode_id(task.game, earlier))) == actions:
                    verdict = f"trial {trial} repeated trial {earlier}'s {len(actions)} actions"
                    store.set_failure_class(row.episode_id, FailureClass.OSCILLATING.value, verdict)
                    store.log_event("oscillation", verdict, row.episode_id)
                    return FailureClass.OSCILLATING.value
        if guards.task_max_tokens is None and guards.task_max_seconds is None:
            return None
        used = store.task_usage(task.game)
        over = []
        if guards.task_max_tokens is not None and used.tokens >= guards.task_max_tokens:
            over.append(f"{used.tokens} tokens >= {guards.task_max_tokens}")
        if guards.task_max_seconds is not None and used.seconds >= guards.task_max_seconds:
            over.append(f"{used.seconds:.1f} s >= {guards.task_max_seconds:g} s")
        if not over:
            return None
        if not any(e.episode_id == row.episode_id for e in store.event_rows("task_budget")):
            store.log_event("task_budget", "; ".join(over), row.episode_id)
        return "budget"

    async def _escalate(self, task: Task) -> None:
        """Re-run an unsolved task once with the escalation model (kept out of the trials)."""
        if self.escalation is None:
            return
        eid = escalation_id(task.game)
        row = self.store.episode(eid)
        if row is not None and row.status == EpisodeStatus.DONE.value:
            return
        self.store.mark_escalation(eid, task.game, self.escalation.model)
        await self._play(task, self.plan.trials, row, self.escalation)

    def _new(self, task: Task, trial: int, escalate: Escalation | None = None) -> EpisodeSpec:
        settings = self.plan.reflexion
        shown = self.plan.memory.recall(settings, _Past(self, task), task.game, trial)
        given = self.plan.experience  # a run given none records none
        join = given is not None and given.settings.retrieve_mode == "join"

        def prompt(retrieved: tuple[Retrieved, ...] = ()) -> tuple[str, Shown | None]:
            experience = Shown(shown.rules, retrieved, join)
            text = reflexion.prompt_prefix(
                settings, task.task_type, shown.reflections, shown.facts, experience
            )
            return text, experience if given is not None else None

        retrieved_for = shown.retrieved_for
        prefix, experience = prompt()
        return EpisodeSpec(
            episode_id=escalation_id(task.game) if escalate else episode_id(task.game, trial),
            game=task.game,
            task_type=task.task_type,
            trial=trial,
            prefix=prefix,
            experience=experience,
            prefix_for=(lambda obs: prompt(retrieved_for(obs))) if retrieved_for else None,
            memory=shown.reflections,
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
        """Judge (LLM evaluator arm), then keep what the arm's memory policy keeps of a failed
        episode (a reflection; ``epm``: its trimmed trajectory), unless already done."""
        row = await self._judge(task, trial, row)
        settings = self.plan.reflexion
        if trial >= self.plan.trials - 1 and not settings.layout.reflects_after_last_trial:
            return  # a memory item after the last trial would never be read (the code writes it)
        if self.plan.llm_judge and row.judge_verdict == "success":
            return  # the self-evaluation arm reflects only when its judge saw a failure
        if any(r.trial == trial for r in self.store.reflections(task.game)):
            return
        if any(  # a reflection the model's context refused is not asked again (on --resume)
            e.episode_id == row.episode_id and e.detail.startswith(NOT_REFLECTED)
            for e in self.store.event_rows("context_limit")
        ):
            return
        failed = Failed(
            task.game, trial, row.episode_id, row.observation, self.store.steps(row.episode_id)
        )
        try:
            made = await self.plan.memory.remember(
                _TaskModel(self.engine, task.game, trial), settings, _Past(self, task), failed
            )
        except ContextLimitError as exc:  # the model's limit, not the harness's: no retry helps
            note = f"{NOT_REFLECTED} (trial {trial}): {context_verdict(exc)}"
            self.store.log_event("context_limit", note, row.episode_id)
            return  # the next trial sees the memory this one saw
        except BackendError as exc:
            raise _TaskHalted(f"{task.game} trial {trial}: reflection failed: {exc}") from exc
        if made is None:
            return
        self.store.add_reflection_note(made.note)
        self.store.add_reflection(made.reflection, made.prompt_tokens, made.completion_tokens)

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
                episode_id=row.episode_id,
            )
        except ContextLimitError as exc:  # the transcript outgrew the judge's context
            verdict, reason = "unclear", context_verdict(exc)
            self.store.log_event(
                "context_limit", f"judge of trial {trial}: {reason}", row.episode_id
            )
        except BackendError as exc:
            raise _TaskHalted(f"{task.game} trial {trial}: judge failed: {exc}") from exc
        self.store.set_judge(row.episode_id, verdict, reason)
        fresh = self.store.episode(row.episode_id)
        assert fresh is not None
        return fresh

    async def _trial_summary(self, trial: int) -> code.TrialSummary:
        """The counts the paper's code appends to its trial log, which its log split hands to the
        reflection of the run's last game: waits until every task's trial ``trial`` is played."""
        while True:
            rows = {(e.game, e.trial): e for e in self.store.episodes()}
            settled = all(
                self._at[t.game] > trial
                or (
                    (row := rows.get((t.game, trial))) is not None
                    and row.status == EpisodeStatus.DONE.value
                )
                for t in self._tasks
            )
            if settled or self.engine.stopped is not None:
                break
            self._moved.clear()
            await self._moved.wait()
        won = {(e.game, e.trial) for e in rows.values() if e.won and e.trial <= trial}
        return code.TrialSummary(
            successes=len({g for g, _ in won}),
            additional=sum(1 for _, k in won if k == trial),
            total=len(self._tasks),
        )

    # -- trial bookkeeping ------------------------------------------------------------------------
    def _advance(self, task: Task, trial: float) -> None:
        """Task ``task`` is now at ``trial``; close every trial no task can still join."""
        self._at[task.game] = trial
        self._moved.set()
        if trial != float("inf"):
            self._open_trials.add(int(trial))
        if self.engine.stopped is not None or not self.whole_run:
            return
        lowest = min(self._at.values(), default=float("inf"))
        for k in sorted(self._open_trials):
            if k < lowest:
                self.store.finish_trial(k)
                self._open_trials.discard(k)


class _Past:
    """A task's earlier trials from the run store (:class:`agents.memory_policy.PastTrials`)."""

    def __init__(self, loop: TrialLoop, task: Task) -> None:
        self.loop = loop
        self.task = task
        self.task_type = task.task_type
        self.experience = loop.plan.experience

    def reflections(self) -> list[Reflection]:
        return self.loop.store.reflections(self.task.game)

    def steps_before(self, trial: int) -> list[tuple[int, list[Step]]]:
        store = self.loop.store
        return [
            (e.trial, store.steps(e.episode_id))
            for e in store.episodes()
            if e.game == self.task.game and e.trial < trial
        ]

    async def trial_summary(self, trial: int) -> code.TrialSummary | None:
        tasks = self.loop._tasks
        if tasks and self.task == tasks[-1]:
            return await self.loop._trial_summary(trial)
        return None


class _TaskModel:
    """Model access for a task's calls between episodes (reflect, judge), recorded as such."""

    def __init__(self, engine: Engine, game: str, trial: int) -> None:
        self.engine = engine
        self.game = game
        self.trial = trial

    async def generate(self, request: Request) -> Completion:
        """The call, asked again when the model's engine died under it and was rebuilt (the
        request holds everything it needs; the backend caps the rebuilds)."""
        for _ in range(RESTART_RERUNS):
            try:
                return await self.engine.generate(request, self.game, self.trial)
            except ModelRestarted:
                continue
        return await self.engine.generate(request, self.game, self.trial)
