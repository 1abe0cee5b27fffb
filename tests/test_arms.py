"""Arms are plug-ins: a toy arm, declared here and not in the package, is registered and played
through the command line's entry code like any built-in arm."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents import arms
from agents.arm import Arm, ArmContext
from agents.episode import EpisodeContext, EpisodeEnd
from agents.episode import ModelPort as Model
from agents.memory_policy import Failed, PastTrials, Recall
from agents.parsing import parse_action
from agents.react import THOUGHT_OBSERVATION, actor_request, make_step
from agents.reflexion import Reflected, ReflexionSettings
from experiments.cli import main
from experiments.store import RunStore
from memory.records import FailureClass, Reflection, ReflectionNote, Step, StepKind

SPLIT = "eval_out_of_distribution"
NOTE = "toy note: last time I only looked around; this time I follow the task."


class ToyAgent:
    """A bare actor loop of its own: ask, act, stop when won or out of steps."""

    built = 0

    def __init__(self, ctx: ArmContext) -> None:
        self.actor = ctx.actor
        ToyAgent.built += 1

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        spec = ctx.spec
        state = await ctx.reset(spec.replay_actions())
        observation = spec.resumed_observation or state.observation
        steps: list[Step] = list(spec.resume_steps)
        while len(steps) < self.actor.max_steps:
            request = actor_request(
                self.actor, spec.prefix, observation, steps, state,
                game=spec.game, trial=spec.trial, seed=spec.seed,
            )  # fmt: skip
            completion = await ctx.generate(request)
            parsed = parse_action(completion.text, self.actor.grounding)
            if parsed.kind == StepKind.ACT:
                state = await ctx.step(parsed.action)
                step = make_step(len(steps), parsed, completion, state.observation, True, state)
            else:
                step = make_step(len(steps), parsed, completion, THOUGHT_OBSERVATION, True)
            steps.append(step)
            ctx.record(step)
            if step.won:
                return EpisodeEnd(won=True)
        return EpisodeEnd(
            won=False, failure_class=FailureClass.STEP_CAP.value, verdict="toy: out of steps"
        )


class ToyNotes:
    """A memory policy of its own: one fixed note per failed trial, no model call."""

    reflects = False

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        return Recall(tuple(r for r in past.reflections() if r.trial < trial))

    async def remember(
        self, model: Model, settings: ReflexionSettings, past: PastTrials, failed: Failed
    ) -> Reflected | None:
        item = Reflection(failed.task, failed.trial, failed.episode_id, "toy", "toy", NOTE)
        note = ReflectionNote(failed.task, failed.trial, "toy", len(NOTE), raw="")
        return Reflected(item, 0, 0, note)


@pytest.fixture
def toy() -> Iterator[Arm]:
    arm = arms.register(Arm("toy", ToyAgent, ToyNotes()))
    try:
        yield arm
    finally:
        arms.unregister("toy")


def run_args(games: Path, run_dir: Path) -> list[str]:
    return [
        "run", "--agent", "toy", "--model", "scripted:learner", "--data", str(games),
        "--split", SPLIT, "--games", "1", "--trials", "2", "--max-steps", "12",
        "--run-dir", str(run_dir),
    ]  # fmt: skip


def test_an_arm_registered_outside_the_package_plays_through_the_cli(
    toy: Arm, generated_games: Path, tmp_path: Path
) -> None:
    ToyAgent.built = 0
    run_dir = tmp_path / "toy"
    assert main(run_args(generated_games, run_dir)) == 0
    assert ToyAgent.built == 1  # the runner built the agent through the registry
    store = RunStore(run_dir, readonly=True)
    try:
        first, second = sorted(store.episodes(), key=lambda e: e.trial)
        assert {first.arm, second.arm} == {"toy"}
        # the learner repeats `look` until its prompt shows a memory block: the toy policy's note
        assert not first.won and NOTE not in first.prompt_prefix
        assert second.won and NOTE in second.prompt_prefix
        (item,) = store.reflections()
        assert item.text == NOTE and item.model == "toy"
        assert store.get_meta("manifest")["config"]["agent"] == "toy"
    finally:
        store.close()


def test_the_toy_arm_is_a_choice_only_while_registered(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(run_args(generated_games, tmp_path / "never"))
    assert exited.value.code == 2 and "invalid choice: 'toy'" in capsys.readouterr().err
    arms.register(Arm("toy", ToyAgent, ToyNotes()))
    try:
        assert main([*run_args(generated_games, tmp_path / "dry"), "--dry-run"]) == 0
    finally:
        arms.unregister("toy")
    plan = json.loads(capsys.readouterr().out)
    assert plan["arm"] == "toy"
    assert plan["estimated_requests"]["reflections_at_most"] == 0  # its policy calls no model


def test_builtin_arms_keep_their_order_and_memory() -> None:
    assert arms.names()[:8] == (
        "react", "reflexion", "reflexion+explore", "epm", "plan", "plan+reflexion", "lats",
        "lats+reflexion",
    )  # fmt: skip
    reflecting = {n for n in arms.names() if arms.get(n).memory.reflects}
    assert reflecting == {
        "reflexion", "reflexion+explore", "plan+reflexion", "lats+reflexion", "insights", "retrieve",
    }  # fmt: skip
    with pytest.raises(ValueError, match="already registered"):
        arms.register(arms.get("react"))
