"""Write run stores with known outcomes, the way the runner writes them (for report/viewer tests).

Only the model's text is made up; the store, prompts and records are the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agents.prompting import actor_prefix, example_texts, sha256
from envs.discovery import SHORT_TO_LONG
from experiments.store import RunStore, episode_id
from memory.records import Reflection, Step

# Untrusted model text that would run script if a page ever treated it as HTML.
PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=1">'

STEP_PROMPT_TOKENS = 100
STEP_COMPLETION_TOKENS = 5
STEP_CACHED_TOKENS = 80
REFLECTION_PROMPT_TOKENS = 50
REFLECTION_COMPLETION_TOKENS = 20

# The run directories committed under experiments/results (none in a checkout without them).
RESULTS = Path(__file__).resolve().parent.parent.parent / "experiments" / "results"
COMMITTED = sorted(p.parent for p in RESULTS.glob("*/*/run.sqlite"))
# the committed runs written by schema version 1 (read as they are; the others are current)
COMMITTED_V1 = [d for d in COMMITTED if d.parent.name == "scale-cpu-valid_seen"]


@dataclass(frozen=True)
class TaskPlan:
    """One task and what happens in each trial it runs: ``won``, ``fail:<class>``, ``error``,
    ``running`` (the episode is still being played). The last entry repeats."""

    game: str
    task_type: str
    outcomes: tuple[str, ...]


def game_id(task_type: str, n: int) -> str:
    return (
        f"json_2.1.1/valid_seen/{SHORT_TO_LONG[task_type]}-Apple-None-Fridge-{n}/trial_T2019{n:04d}"
    )


def task(task_type: str, n: int, *outcomes: str) -> TaskPlan:
    return TaskPlan(game_id(task_type, n), task_type, tuple(outcomes))


def first_observation(task_type: str) -> str:
    return (
        "You are in the middle of a room. Looking quickly around you, you see a countertop 1, "
        f"a fridge 1, and a sinkbasin 1.\n\nYour task is to: {task_text(task_type)}."
    )


def task_text(task_type: str) -> str:
    return f"{task_type} some apple & put it in fridge"


def episode_steps(outcome: str) -> list[Step]:
    """A short, realistic episode: a thought, actions, an invalid output, an inadmissible action."""

    def step(i: int, kind: str, raw: str, action: str, obs: str, **kw: object) -> Step:
        return Step(
            index=i,
            kind=kind,
            raw_output=raw,
            action=action,
            observation=obs,
            prompt_tokens=STEP_PROMPT_TOKENS,
            completion_tokens=STEP_COMPLETION_TOKENS,
            cached_tokens=STEP_CACHED_TOKENS,
            latency_s=0.25,
            **kw,  # type: ignore[arg-type]
        )

    steps = [
        step(0, "think", f" think: {PAYLOAD}", f"think: {PAYLOAD}", "OK."),
        step(1, "act", " go to countertop 1", "go to countertop 1",
             "You arrive at countertop 1. On the countertop 1, you see a apple 1."),
        step(2, "invalid", "   ", "", "Nothing happens.", admissible=False),
        step(3, "act", " take banana 9 from countertop 1", "take banana 9 from countertop 1",
             "Nothing happens.", admissible=False),
    ]  # fmt: skip
    if outcome == "won":
        steps.append(
            # written loosely; nearest decoding chose the admissible command (a mapped step)
            step(4, "act", " move the apple to the fridge", "move apple 1 to fridge 1",
                 "You move the apple 1 to the fridge 1.", reward=1.0, won=True)
        )  # fmt: skip
    elif outcome.startswith("fail:"):
        steps.append(step(4, "act", " look", "look", "You are in the middle of a room."))
    return steps


def make_run(
    run_dir: Path,
    tasks: Sequence[TaskPlan],
    *,
    model: str = "scripted:learner",
    arm: str = "reflexion",
    evaluator: str = "paper",
    trials: int = 3,
    memory_size: int = 3,
    wall_s: float | None = 12.5,
    complete: bool = True,
) -> Path:
    """A run store in ``run_dir`` with the planned outcomes; returns ``run_dir``."""
    store = RunStore(run_dir, create=True)
    try:
        store.set_meta(
            "manifest",
            {
                "config": {
                    "model": model,
                    "agent": arm,
                    "evaluator": evaluator,
                    "trials": trials,
                    "memory_size": memory_size,
                    "max_steps": 30,
                    "reflect_model": model,
                },
                "games": {t.game: sha256(t.game) for t in tasks},
                "started_at": 1_700_000_000.0,
            },
        )
        solved: set[str] = set()
        for k in range(trials):
            todo = [t for t in tasks if t.game not in solved]
            if not todo:
                break
            store.start_trial(k, [t.game for t in todo])
            for t in todo:
                outcome = t.outcomes[min(k, len(t.outcomes) - 1)]
                _play(store, t, k, outcome, arm, model, evaluator, memory_size)
                if outcome == "won":
                    solved.add(t.game)
            if all(t.outcomes[min(k, len(t.outcomes) - 1)] != "running" for t in todo):
                store.finish_trial(k)
        if wall_s is not None:
            store.set_meta("wall_s", wall_s)
        if complete:  # every task's trials are over: the store derives "complete"
            for t in tasks:
                won = [k for k in range(trials) if t.outcomes[min(k, len(t.outcomes) - 1)] == "won"]
                store.end_task(t.game, won[0] if won else trials - 1, "solved" if won else "trials")
    finally:
        store.close()
    return run_dir


def _play(
    store: RunStore,
    t: TaskPlan,
    trial: int,
    outcome: str,
    arm: str,
    model: str,
    evaluator: str,
    memory_size: int,
) -> None:
    ep = episode_id(t.game, trial)
    memory: list[Reflection] = []
    if arm != "react" and memory_size:
        memory = [r for r in store.reflections(t.game) if r.trial < trial][-memory_size:]
    store.start_episode(
        episode_id=ep,
        game=t.game,
        task_type=t.task_type,
        trial=trial,
        arm=arm,
        prompt_prefix=actor_prefix(example_texts(t.task_type), memory),
        observation=first_observation(t.task_type),
        task=task_text(t.task_type),
        memory=memory,
    )
    steps = episode_steps(outcome)
    if outcome == "error":
        steps = steps[:1]
    for s in steps:
        store.add_step(ep, s)
    if outcome == "running":
        return
    if outcome == "error":
        store.log_event("infra_error", "BackendError: connection refused", ep)
        store.finish_episode(
            ep, status="error", won=False, failure_class="infra_error",
            error="backend: connection refused",
        )  # fmt: skip
        return
    won = outcome == "won"
    failure = None if won else outcome.removeprefix("fail:")
    store.finish_episode(ep, status="done", won=won, failure_class=failure, verdict=failure)
    if evaluator == "llm":
        store.set_judge(ep, "success" if won else "failure", f"judge says {PAYLOAD}")
    if not won and arm != "react":
        store.add_reflection(
            Reflection(
                task=t.game,
                trial=trial,
                episode_id=ep,
                model=model,
                prompt_hash=sha256(ep),
                text=f"Trial {trial}: I should take apple 1 first, not banana 9. {PAYLOAD}",
            ),
            prompt_tokens=REFLECTION_PROMPT_TOKENS,
            completion_tokens=REFLECTION_COMPLETION_TOKENS,
        )


def standard_tasks() -> list[TaskPlan]:
    """Four tasks: solved at trial 0, at trial 1, at trial 2 (after an error), never."""
    return [
        task("put", 1, "won"),
        task("clean", 2, "fail:repeated_action", "won"),
        task("heat", 3, "error", "fail:step_cap", "won"),
        task("cool", 4, "fail:invalid_actions", "fail:too_long", "fail:repeated_action"),
    ]


def many_tasks(copies: int) -> list[TaskPlan]:
    """The standard tasks, each played by ``copies`` games (a store of many pages)."""
    return [
        task(t.task_type, 10 * i + n, *t.outcomes)
        for i in range(copies)
        for n, t in enumerate(standard_tasks())
    ]


def baseline_tasks() -> list[TaskPlan]:
    """The same tasks as a weaker arm: solved at trial 0 and at trial 1 only."""
    return [
        task("put", 1, "won"),
        task("clean", 2, "fail:repeated_action"),
        task("heat", 3, "fail:step_cap", "won"),
        task("cool", 4, "fail:other"),
    ]
