"""Plan-and-Execute end to end on generated games: real envs, real run store, scripted text."""

from __future__ import annotations

from pathlib import Path

from agents.llm.markers import PLAN_PREFIX, REPLAN_PREFIX, plan_items, render_plan
from agents.plan_execute import parse_plan, plan_example
from agents.prompting import example_texts
from experiments.config import RunConfig
from experiments.session import run
from experiments.store import RunStore
from memory.records import StepKind
from tests.support.gameruns import game_run


def config(data: Path, tmp: Path, name: str, agent: str = "plan", **kw: object) -> RunConfig:
    return game_run(data, tmp, name, agent, **kw)


def test_parse_plan_reads_numbered_and_bulleted_lists() -> None:
    text = "1. go to desk 1\n2) take pen 1 from desk 1\n  3: > move pen 1 to shelf 2\nthen done"
    assert parse_plan(text) == ["go to desk 1", "take pen 1 from desk 1", "move pen 1 to shelf 2"]
    assert parse_plan("- open fridge 1\n* cool mug 1 with fridge 1") == [
        "open fridge 1",
        "cool mug 1 with fridge 1",
    ]
    assert parse_plan("just go to the sink") == ["just go to the sink"]
    assert parse_plan("") == [] and parse_plan("\n\n") == []
    assert len(parse_plan("\n".join(f"{i}. look" for i in range(1, 50)), limit=5)) == 5
    items = ["go to desk 1", "take pen 1 from desk 1"]
    assert plan_items(PLAN_PREFIX + render_plan(items)) == items
    assert plan_items(REPLAN_PREFIX + render_plan([])) == []


def test_plan_examples_come_from_the_solved_transcripts() -> None:
    first, _ = example_texts("put")
    example = plan_example(first)
    assert "Your task is to:" in example and "\nPlan:\n1. go to " in example
    assert "think:" not in example.split("Plan:")[1]


def test_expert_plan_and_execute_wins_all_six(generated_games: Path, tmp_path: Path) -> None:
    store = RunStore(run(config(generated_games, tmp_path, "run", model="scripted:expert")),
                     readonly=True)  # fmt: skip
    episodes = store.episodes()
    assert len(episodes) == 6 and all(e.won for e in episodes)
    for e in episodes:
        steps = store.steps(e.episode_id)
        plan = steps[0]
        assert plan.kind == StepKind.THINK and plan.action.startswith(PLAN_PREFIX)
        assert plan.observation == "OK."
        acts = [s.action for s in steps if s.kind == StepKind.ACT]
        assert plan_items(plan.action) == acts  # the expert's plan is the walkthrough it played
        assert not any(s.action.startswith(REPLAN_PREFIX) for s in steps)
    assert store.calls_by_purpose()["plan"].calls == 6


def test_a_failed_first_plan_is_replanned_and_wins(generated_games: Path, tmp_path: Path) -> None:
    cfg = config(generated_games, tmp_path, "run", model="scripted:replanner", games=2)
    store = RunStore(run(cfg), readonly=True)
    for e in store.episodes():
        assert e.won
        steps = store.steps(e.episode_id)
        kinds = [s.action.split(":")[1].strip() for s in steps if s.kind == StepKind.THINK]
        assert kinds == ["Plan", "Revised plan for the remaining steps"]
        replan = next(i for i, s in enumerate(steps) if s.action.startswith(REPLAN_PREFIX))
        # the signal: three "Nothing happens." in a row, then the replanner writes the rest
        assert [s.observation for s in steps[replan - 3 : replan]] == ["Nothing happens."] * 3
        assert plan_items(steps[replan].action) == [
            s.action for s in steps[replan + 1 :] if s.kind == StepKind.ACT
        ]
    store.close()
    # without replans, the same first plan fails
    cfg = config(
        generated_games, tmp_path, "norun", model="scripted:replanner", games=1, max_replans=0
    )
    store = RunStore(run(cfg), readonly=True)
    (episode,) = store.episodes()
    assert not episode.won and episode.failure_class is not None
    assert store.calls_by_purpose()["plan"].calls == 1


def test_the_planner_model_writes_the_plans(generated_games: Path, tmp_path: Path) -> None:
    cfg = config(
        generated_games, tmp_path, "run", model="scripted:replanner",
        planner_model="scripted:expert", games=1,
    )  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    (episode,) = store.episodes()
    steps = store.steps(episode.episode_id)
    # the expert's plan (the walkthrough), executed by the actor that follows plans
    assert episode.won and "examine the ceiling" not in steps[0].raw_output
    assert [s.action for s in steps if s.kind == StepKind.THINK] == [steps[0].action]
