"""The trial loop of Reflexion: run the unsolved tasks, reflect on failures, repeat.

Trial k re-runs only the tasks not solved in trials 0..k-1; success at trial k is cumulative.
Arms: ``react`` re-runs failed tasks without memory (the resampling baseline), ``reflexion`` shows
the last Ω reflections, ``reflexion+explore`` also shows what earlier trials found in each place.
Everything is read back from the run store, so a resumed run picks up exactly where it stopped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.explore import extract_facts
from agents.llm.base import Backend, BackendError, GenerationConfig, Request
from agents.prompting import (
    actor_prefix,
    example_texts,
    judge_prompt,
    parse_judge,
    reflection_prompt,
    sha256,
)
from experiments.rollout import EpisodeJob, Rollout
from experiments.store import EpisodeRow, RunStore, episode_id
from memory.records import EpisodeStatus, ExplorationFact, Reflection
from memory.window import TaskMemory

log = logging.getLogger("reflexsim.trials")


@dataclass(frozen=True)
class Task:
    game: str
    task_type: str


@dataclass(frozen=True)
class TrialSettings:
    arm: str
    trials: int
    memory_size: int
    evaluator: str
    reflect_model: str
    reflect_max_tokens: int = 256
    prompts_file: str | None = None
    seed: int = 0


def solved_before(store: RunStore, trial: int) -> set[str]:
    return {e.game for e in store.episodes() if e.won and e.trial < trial}


def task_memory(store: RunStore, game: str, trial: int, size: int) -> TaskMemory:
    memory = TaskMemory(task=game, size=size)
    for r in store.reflections(game):
        if r.trial < trial:
            memory.add(r)
    return memory


def exploration_facts(store: RunStore, game: str, trial: int) -> list[ExplorationFact]:
    memory = TaskMemory(task=game)
    for e in store.episodes():
        if e.game == game and e.trial < trial:
            for fact in extract_facts(store.steps(e.episode_id), e.trial):
                memory.observe(fact)
    return memory.known_places()


def build_job(store: RunStore, task: Task, trial: int, settings: TrialSettings) -> EpisodeJob:
    reflections: list[Reflection] = []
    facts: list[ExplorationFact] = []
    if settings.arm != "react":
        reflections = task_memory(store, task.game, trial, settings.memory_size).visible()
    if settings.arm == "reflexion+explore":
        facts = exploration_facts(store, task.game, trial)
    prefix = actor_prefix(example_texts(task.task_type, settings.prompts_file), reflections, facts)
    return EpisodeJob(
        episode_id=episode_id(task.game, trial),
        game=task.game,
        task_type=task.task_type,
        trial=trial,
        prefix=prefix,
        memory=tuple(reflections),
    )


def plan_trial(
    store: RunStore, tasks: Sequence[Task], trial: int, settings: TrialSettings
) -> tuple[list[Task], list[EpisodeJob]]:
    """The tasks trial ``trial`` runs, and the jobs still to play (resumed ones included)."""
    solved = solved_before(store, trial)
    todo = [t for t in tasks if t.game not in solved]
    jobs: list[EpisodeJob] = []
    for task in todo:
        row = store.episode(episode_id(task.game, trial))
        if row is not None and row.status == EpisodeStatus.DONE.value:
            continue
        if row is not None and row.status == EpisodeStatus.ERROR.value:
            store.retry_episode(row.episode_id)  # the harness failed, not the agent: play it again
            row = store.episode(row.episode_id)
        if row is None:
            jobs.append(build_job(store, task, trial, settings))
            continue
        # interrupted mid-episode: same prompt as recorded, continue from its next step
        memory = tuple(Reflection.from_dict(r) for r in json.loads(row.memory_json))
        jobs.append(
            EpisodeJob(
                episode_id=row.episode_id,
                game=row.game,
                task_type=row.task_type,
                trial=trial,
                prefix=row.prompt_prefix,
                memory=memory,
                resume_steps=tuple(store.steps(row.episode_id)),
                resumed=True,
            )
        )
    return todo, jobs


REFLECTION_STOPS = ("\n\n", "\n>")


def reflect(store: RunStore, backend: Backend, trial: int, settings: TrialSettings) -> None:
    """Write a reflection for every failed episode of the trial that has none yet (batched)."""
    if settings.arm == "react":
        return
    have = {(r.task, r.trial) for r in store.reflections()}
    pending: list[tuple[EpisodeRow, str]] = []
    for e in store.episodes(trial):
        if e.status != EpisodeStatus.DONE.value or e.won or (e.game, trial) in have:
            continue
        if settings.evaluator == "llm" and e.judge_verdict == "success":
            continue  # the self-evaluation arm only reflects when its judge saw a failure
        steps = store.steps(e.episode_id)
        pending.append(
            (
                e,
                reflection_prompt(
                    e.observation, [(s.action or s.raw_output, s.observation) for s in steps]
                ),
            )
        )
    if not pending:
        return
    # one paragraph, as in the examples; greedy, at most reflect_max_tokens (256) tokens. A new
    # line that starts with ">" is the model writing transcript again, not a plan: it ends the
    # reflection too (small models otherwise repeat one "> ..." line until the token cap).
    config = GenerationConfig(
        temperature=0.0,
        max_tokens=settings.reflect_max_tokens,
        stop=REFLECTION_STOPS,
        seed=settings.seed,
    )
    requests = [
        Request(
            config=config, prompt=prompt, purpose="reflect", side={"game": e.game, "trial": trial}
        )
        for e, prompt in pending
    ]
    try:
        completions = backend.generate(requests)
    except BackendError as exc:
        store.log_event("infra_error", f"reflection batch failed: {exc}")
        return  # the next resume (or trial) retries: reflections are keyed by (task, trial)
    for (e, prompt), c in zip(pending, completions, strict=True):
        text = c.text.strip() or "(the model wrote no reflection)"
        store.add_reflection(
            Reflection(
                task=e.game,
                trial=trial,
                episode_id=e.episode_id,
                model=settings.reflect_model,
                prompt_hash=sha256(prompt),
                text=text,
            ),
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
        )


def judge(store: RunStore, backend: Backend, trial: int, settings: TrialSettings) -> None:
    """The LLM evaluator: record its verdict next to the env's truth (never replacing it)."""
    rows = [
        e
        for e in store.episodes(trial)
        if e.status == EpisodeStatus.DONE.value and e.judge_verdict is None
    ]
    if not rows:
        return
    config = GenerationConfig(temperature=0.0, max_tokens=64, stop=("\n",), seed=settings.seed)
    requests = []
    for e in rows:
        steps = store.steps(e.episode_id)
        history = [(s.action or s.raw_output, s.observation) for s in steps]
        requests.append(
            Request(
                config=config,
                prompt=judge_prompt(e.observation, history),
                purpose="judge",
                side={"game": e.game, "trial": trial, "history": [a for a, _ in history]},
            )
        )
    try:
        completions = backend.generate(requests)
    except BackendError as exc:
        store.log_event("infra_error", f"judge batch failed: {exc}")
        return
    for e, c in zip(rows, completions, strict=True):
        verdict, reason = parse_judge(c.text)
        store.set_judge(e.episode_id, verdict, reason)


def run_trials(
    store: RunStore,
    tasks: Sequence[Task],
    rollout: Rollout,
    reflector: Backend,
    settings: TrialSettings,
    on_trial: Callable[[int, int], None] = lambda trial, n: None,
) -> str | None:
    """All trials; returns None when complete, or why it stopped early (budget, deadline)."""
    for trial in range(settings.trials):
        todo, jobs = plan_trial(store, tasks, trial, settings)
        if not todo:
            log.info("trial %d: every task is solved", trial)
            break
        store.start_trial(trial, [t.game for t in todo])
        on_trial(trial, len(jobs))  # episodes still to play: a resumed trial counts only those
        stopped = rollout.run(jobs)
        if stopped:
            return stopped
        if settings.evaluator == "llm":
            judge(store, reflector, trial, settings)
        if trial < settings.trials - 1:  # a reflection after the last trial would never be read
            reflect(store, reflector, trial, settings)
        store.finish_trial(trial)
    return None
