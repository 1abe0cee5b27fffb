"""Safeguards of reflect-then-retry: oscillation stop, per-task budgets, escalation, the epm
control arm, critique reflections and the reflection length cap (real envs and run store,
scripted model text)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents import reflexion
from agents.llm.base import Completion, Request
from agents.llm.ground_truth import GroundTruth
from agents.reflexion import ReflexionSettings, parse_critique, trimmed_trajectory
from experiments.config import RunConfig
from experiments.report import summarize
from experiments.session import run
from experiments.store import RunStore, escalation_id
from memory.records import FailureClass, StepKind
from tests.support.runfactory import episode_steps

SPLIT = "eval_out_of_distribution"


def config(data: Path, tmp: Path, **kw: object) -> RunConfig:
    base: dict[str, object] = dict(
        data=str(data), split=SPLIT, workers=1, concurrency=2, run_dir=str(tmp / "run"),
        model="scripted:learner", games=1, max_steps=8,
    )  # fmt: skip
    base.update(kw)
    return RunConfig.of(**base)


class _Port:
    """A backend as the model port that reflect() takes."""

    def __init__(self, spec: str) -> None:
        from agents.llm import make_backend

        self.backend = make_backend(spec)

    async def generate(self, request: Request) -> Completion:
        return self.backend.generate([request])[0]


def test_a_trial_that_repeats_an_earlier_one_stops_the_task(
    generated_games: Path, tmp_path: Path
) -> None:
    # the react arm never shows memory: the learner repeats its first trial exactly
    cfg = config(generated_games, tmp_path, agent="react", trials=4, oscillation_stop=True)
    store = RunStore(run(cfg), readonly=True)
    episodes = store.episodes()
    assert [e.trial for e in episodes] == [0, 1]  # trials 2 and 3 never played
    assert episodes[0].failure_class == FailureClass.REPEATED_ACTION
    assert episodes[1].failure_class == FailureClass.OSCILLATING
    assert episodes[1].verdict is not None and "repeated trial 0" in episodes[1].verdict
    assert len(store.events("oscillation")) == 1
    assert summarize(store).failure_classes["oscillating"] == 1
    # given up by a rule: the run is complete with trials 2 and 3 unplayed
    assert store.task_ends() == {episodes[0].game: "oscillating"} and store.run_state().complete


def test_a_task_over_its_token_budget_is_not_retried(generated_games: Path, tmp_path: Path) -> None:
    cfg = config(generated_games, tmp_path, agent="reflexion", trials=3, task_max_tokens=1)
    store = RunStore(run(cfg), readonly=True)
    assert [e.trial for e in store.episodes()] == [0]
    assert store.reflections() == []  # no reflection for a trial that will not come
    (event,) = store.events("task_budget")
    assert "tokens >= 1" in event["detail"]
    assert set(store.task_ends().values()) == {"task_budget"} and store.run_state().complete


def test_epm_keeps_the_failed_trajectory_instead_of_a_reflection(
    generated_games: Path, tmp_path: Path
) -> None:
    cfg = config(generated_games, tmp_path, agent="epm", trials=2, reflection_max_chars=60)
    store = RunStore(run(cfg), readonly=True)
    first, second = store.episodes()
    assert not first.won and second.won  # the learner plays well once its prompt has memory
    (item,) = store.reflections()
    full = trimmed_trajectory(store.steps(first.episode_id))
    assert full.startswith("> look\n") and "think:" not in full
    assert item.model == "epm" and len(item.text) == 60 and item.text.endswith("…")
    assert full.startswith(item.text[:-1])
    (note,) = store.reflection_notes()
    assert note.format == "epm" and note.truncated_from == len(full) and note.chars == 60
    assert "reflect" not in store.calls_by_purpose()  # no model wrote it
    assert item.text in second.prompt_prefix


def test_trimmed_trajectory_keeps_actions_and_observations_only() -> None:
    steps = episode_steps("fail:repeated_action")  # a thought, acts, an invalid output
    text = trimmed_trajectory(steps)
    acts = [s for s in steps if s.kind == StepKind.ACT]
    assert text.splitlines() == [line for s in acts for line in (f"> {s.action}", s.observation)]
    assert trimmed_trajectory([]) == reflexion.NO_ACTIONS


def test_critique_falls_back_to_free_text_with_the_parse_error(
    generated_games: Path, tmp_path: Path
) -> None:
    cfg = config(generated_games, tmp_path, agent="reflexion", trials=2,
                 reflection_format="critique")  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    (item,) = store.reflections()
    (note,) = store.reflection_notes()
    assert note.format == "critique" and note.parse_error == "no JSON object in the text"
    assert item.text == note.raw.strip() and item.text.startswith("I repeated")
    assert store.episodes()[1].won


def reflect(spec: str, steps: Sequence[Any], **settings: Any) -> reflexion.Reflected:
    cfg = ReflexionSettings(3, spec, **settings)
    return asyncio.run(
        reflexion.reflect(
            _Port(spec), cfg, task="game", trial=0, episode_id="game#t0",
            observation="You are in the middle of a room.", steps=steps,
        )
    )  # fmt: skip


def test_critique_json_is_checked_and_rendered() -> None:
    steps = episode_steps("fail:repeated_action")
    made = reflect("scripted:expert", steps, reflection_format="critique")
    assert made.note.parse_error is None and made.note.format == "critique"
    assert json.loads(made.note.raw)["superfluous"]
    assert made.reflection.text.startswith("Missing: ") and " Plan: " in made.reflection.text
    ok = '{"missing": ["take apple 1"], "superfluous": [], "plan": "Take it."}'
    assert parse_critique(f"Sure: {ok} done")[0] == json.loads(ok)
    for bad, why in [
        ('{"missing": [], "plan": "x"}', "keys must be exactly"),
        ('{"missing": "take", "superfluous": [], "plan": "x"}', "list of strings"),
        ('{"missing": [], "superfluous": [], "plan": " "}', "non-empty string"),
        ('{"missing": [}', "invalid JSON"),
        ("[1, 2]", "no JSON object"),
    ]:
        data, error = parse_critique(bad)
        assert data is None and error is not None and why in error, bad


def test_the_reflection_cap_cuts_and_records() -> None:
    steps = episode_steps("fail:repeated_action")
    full = reflect("scripted:learner", steps)
    assert full.note.truncated_from is None and full.note.chars == len(full.reflection.text)
    cut = reflect("scripted:learner", steps, reflection_max_chars=40)
    assert len(cut.reflection.text) == 40 and cut.reflection.text.endswith("…")
    assert cut.note.truncated_from == len(full.reflection.text)


class _ByGame:
    """Scripted text: the expert's for the games in ``solved``, the learner's for the others."""

    def __init__(self, solved: set[str], truth: GroundTruth) -> None:
        from agents.llm import make_backend

        self.name = "by-game"
        self.solved = solved
        self.expert = make_backend("scripted:expert", ground_truth=truth)
        self.learner = make_backend("scripted:learner", ground_truth=truth)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return [
            (self.expert if r.site.game in self.solved else self.learner).generate([r])[0]
            for r in requests
        ]

    def close(self) -> None:
        pass


class _Counting:
    def __init__(self, spec: str, truth: GroundTruth) -> None:
        from agents.llm import make_backend

        self.inner = make_backend(spec, ground_truth=truth)
        self.name = spec
        self.games: list[str] = []

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        self.games += [str(r.site.game) for r in requests]
        return self.inner.generate(requests)

    def close(self) -> None:
        self.inner.close()


def test_escalation_reruns_only_unsolved_tasks_with_the_second_model(
    generated_games: Path, tmp_path: Path
) -> None:
    from envs.aio import AsyncEnvPool
    from envs.pool import EnvSpec, SyncEnvPool
    from experiments.arming import build_agent, trial_plan_of
    from experiments.engine import Engine, ModelClient
    from experiments.games import select_games
    from experiments.trials import Escalation, TrialLoop

    cfg = config(generated_games, tmp_path, agent="react", trials=2, games=2,
                 escalate_model="scripted:expert")  # fmt: skip
    games = select_games(cfg)
    solved, unsolved = (t.game for t in games.tasks)
    store = RunStore(tmp_path / "run", create=True)
    pool = SyncEnvPool(EnvSpec(games.env_kind, games.env_kwargs), slots=2)
    second = _Counting("scripted:expert", games.ground_truth)

    async def play() -> str | None:
        engine = Engine(
            store,
            ModelClient(_ByGame({solved}, games.ground_truth)),
            AsyncEnvPool(pool),
            arm="react",
        )
        loop = TrialLoop(
            store, engine, build_agent(cfg), trial_plan_of(cfg),
            escalation=Escalation("scripted:expert", ModelClient(second)),
        )  # fmt: skip
        return await loop.run(games.tasks)

    try:
        assert asyncio.run(play()) is None
    finally:
        pool.close()
    # the trials: the first task solved at trial 0, the second never
    outcomes = {(e.game, e.trial): e.won for e in store.episodes()}
    assert outcomes == {(solved, 0): True, (unsolved, 0): False, (unsolved, 1): False}
    # the escalation: the unsolved task only, once, with the second model, kept apart
    assert set(second.games) == {unsolved}
    (escalated,) = store.escalations()
    assert escalated.model == "scripted:expert" and escalated.outcome.won
    assert escalated.outcome.episode_id == escalation_id(unsolved) and escalated.outcome.trial == 2
    summary = summarize(store)
    assert summary.solved == 1 and summary.escalation is not None
    assert summary.escalation.solved == 1 and summary.escalation.games == {unsolved: True}
