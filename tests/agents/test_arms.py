"""Arms are plug-ins: a toy arm, declared here and not in the package, is registered and played
through the command line's entry code like any built-in arm, with its own config section (its
flag, YAML key and ``--help`` text come with it)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from agents import arms
from agents.arm import Arm, ArmContext, ModelRole
from agents.episode import EpisodeContext, EpisodeEnd
from agents.episode import ModelPort as Model
from agents.layout import PromptLayout
from agents.llm.base import CallSite, GenerationConfig, Request
from agents.memory_policy import NO_MEMORY, Failed, PastTrials, Recall
from agents.options import option
from agents.parsing import parse_action
from agents.react import THOUGHT_OBSERVATION, ReActAgent, actor_request, make_step
from agents.reflexion import Reflected, ReflexionSettings
from experiments.cli import main
from experiments.config import RunConfig, from_mapping, model_roles
from experiments.errors import ConfigError
from experiments.store import RunReader, RunStore
from experiments.training_data import sft_records
from experiments.viewer.data import episode_detail, step_prompt
from memory.records import FailureClass, Reflection, ReflectionNote, Step, StepKind

SPLIT = "eval_out_of_distribution"
NOTE = "toy note: last time I only looked around; this time I follow the task."


TOY_HELP = "steps the toy arm takes per episode at most"


@dataclass(frozen=True)
class ToyConfig:
    """The toy arm: a bare actor loop with notes."""

    toy_steps: int = option(12, TOY_HELP, minimum=1)


class ToyAgent:
    """A bare actor loop of its own: ask, act, stop when won or out of ``toy_steps`` steps."""

    built: list[ToyConfig] = []  # the settings of every agent built

    def __init__(self, ctx: ArmContext) -> None:
        self.actor = ctx.actor
        self.settings: ToyConfig = ctx.settings
        ToyAgent.built.append(ctx.settings)

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        spec = ctx.spec
        state = await ctx.reset(spec.replay_actions())
        observation = spec.resumed_observation or state.observation
        steps: list[Step] = list(spec.resume_steps)
        while len(steps) < self.settings.toy_steps:
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


def toy_arm() -> Arm:
    return Arm(
        "toy", ToyAgent, ToyNotes(), "a bare loop with notes", section="toy", settings=ToyConfig
    )


@contextmanager
def registered(arm: Arm) -> Iterator[Arm]:
    arms.register(arm)
    try:
        yield arm
    finally:
        arms.unregister(arm.name)


@pytest.fixture
def toy() -> Iterator[Arm]:
    with registered(toy_arm()) as arm:
        yield arm


def run_args(games: Path, run_dir: Path) -> list[str]:
    return [
        "run", "--agent", "toy", "--model", "scripted:learner", "--data", str(games),
        "--split", SPLIT, "--games", "1", "--trials", "2", "--max-steps", "12",
        "--run-dir", str(run_dir),
    ]  # fmt: skip


@pytest.mark.parametrize("given", ["flag", "yaml"])
def test_an_arm_registered_outside_the_package_plays_through_the_cli(
    toy: Arm, generated_games: Path, tmp_path: Path, given: str
) -> None:
    """The toy's option, given as a flag or as a YAML key of its section, reaches its factory
    and caps its episodes."""
    ToyAgent.built = []
    run_dir = tmp_path / "toy"
    if given == "flag":
        extra = ["--toy-steps", "5"]
    else:
        (tmp_path / "toy.yaml").write_text("toy:\n  toy_steps: 5\n")
        extra = ["--config", str(tmp_path / "toy.yaml")]
    assert main([*run_args(generated_games, run_dir), *extra]) == 0
    assert ToyAgent.built == [ToyConfig(toy_steps=5)]  # built through the registry, once
    store = RunStore(run_dir, readonly=True)
    try:
        first, second = sorted(store.episodes(), key=lambda e: e.trial)
        assert {first.arm, second.arm} == {"toy"}
        # the learner repeats `look` until its prompt shows a memory block: the toy policy's note
        assert not first.won and NOTE not in first.prompt_prefix
        assert len(store.steps(first.episode_id)) == 5  # the toy's cap, not --max-steps 12
        assert second.won and NOTE in second.prompt_prefix
        (item,) = store.reflections()
        assert item.text == NOTE and item.model == "toy"
        config = store.get_meta("manifest")["config"]
        assert config["agent"] == "toy" and config["toy_steps"] == 5
    finally:
        store.close()
    assert "toy:\n  toy_steps: 5\n" in (run_dir / "config.yaml").read_text()


def test_the_toy_section_is_in_help_and_config_only_while_registered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def run_help() -> str:
        with pytest.raises(SystemExit) as exited:
            main(["run", "--help"])
        assert exited.value.code == 0
        return " ".join(capsys.readouterr().out.split())

    with registered(toy_arm()):
        text = run_help()
        # --agent's help lists every registered arm with its summary, the toy's last
        assert "expel (rules and retrieved trajectories), toy (a bare loop with notes)" in text
        assert all(f"{n} (" in text for n in arms.names())
        assert "toy (toy: in YAML): The toy arm: a bare actor loop with notes." in text
        assert f"--toy-steps TOY_STEPS {TOY_HELP} (default: 12)" in text
        assert RunConfig().section("toy") == ToyConfig()
        assert from_mapping({"toy_steps": 3}) == from_mapping({"toy": {"toy-steps": 3}})
        with pytest.raises(ConfigError, match="toy-steps must be >= 1"):
            from_mapping({"toy_steps": 0})
    text = run_help()
    assert "--toy-steps" not in text and "a bare loop with notes" not in text
    with pytest.raises(ConfigError, match="unknown key 'toy_steps'"):
        from_mapping({"toy_steps": 3})


def test_a_section_key_that_clashes_is_refused_at_registration() -> None:
    @dataclass(frozen=True)
    class Clashing:
        """Reuses a protocol key."""

        trials: int = option(1, "trials again")

    with pytest.raises(ValueError, match="'trials' of section 'clash'.*section 'protocol'"):
        arms.register(Arm("clash", ToyAgent, ToyNotes(), section="clash", settings=Clashing))
    with pytest.raises(ValueError, match="section 'lats' is already LatsConfig's"):
        arms.register(Arm("clash", ToyAgent, ToyNotes(), section="lats", settings=ToyConfig))
    assert "clash" not in arms.names() and "clash" not in RunConfig().to_tree()


def test_no_package_file_names_the_toy_arm() -> None:
    root = Path(__file__).resolve().parent.parent.parent
    named = [
        str(path.relative_to(root))
        for package in ("agents", "envs", "memory", "experiments")
        for path in (root / package).rglob("*")
        if path.is_file() and path.suffix in (".py", ".yaml", ".txt", ".json", ".md")
        and ("toy" in path.read_text().lower().split() or "toy_steps" in path.read_text())
    ]  # fmt: skip
    assert named == []


def test_the_toy_arm_is_a_choice_only_while_registered(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(run_args(generated_games, tmp_path / "never"))
    assert exited.value.code == 2 and "invalid choice: 'toy'" in capsys.readouterr().err
    with registered(toy_arm()):
        assert main([*run_args(generated_games, tmp_path / "dry"), "--dry-run"]) == 0
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
        "expel",
    }  # fmt: skip
    with pytest.raises(ValueError, match="already registered"):
        arms.register(arms.get("react"))


# -- an arm with its own prompt line and its own model role --------------------------------------
REMINDER = "coach-line: the last thing seen was: {seen}"  # the arm's own prompt line
COACH = ModelRole("coach", ("coaching",), "coach_model")  # its own model, for its own purpose


@dataclass(frozen=True)
class CoachedConfig:
    """The coached arm: ReAct with a reminder line and a coach asked once an episode."""

    coach_model: str | None = option(None, "the coach's model spec (default: the actor's)")


class ReminderLayout(PromptLayout):
    """ReAct's layout with one line of its own before the prompt's end."""

    @staticmethod
    def actor_prompt(prefix: str, observation: str, steps: Sequence[Step]) -> str:
        seen = steps[-1].observation if steps else observation
        base = PromptLayout.actor_prompt(prefix, observation, steps)
        return base[: -len(">")] + REMINDER.format(seen=seen.splitlines()[0]) + "\n>"


class CoachedAgent(ReActAgent):
    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        spec = ctx.spec
        await ctx.generate(
            Request(
                config=GenerationConfig(temperature=0.0, max_tokens=16, stop=("\n",)),
                prompt=f"Coach me on {spec.game}\n>",
                purpose="coaching",
                site=CallSite(episode=spec.episode_id, game=spec.game, trial=spec.trial),
            )
        )
        return await super().play(ctx)


def coached_arm() -> Arm:
    def build(ctx: ArmContext) -> CoachedAgent:
        return CoachedAgent(replace(ctx.actor, layout=ReminderLayout()))

    return Arm(
        "coached", build, NO_MEMORY, "ReAct with a coach", section="coached",
        settings=CoachedConfig, roles=(COACH,),
    )  # fmt: skip


def test_an_arm_with_its_own_prompt_line_and_model_role(
    generated_games: Path, tmp_path: Path
) -> None:
    """The coached arm's reminder line is in every request the actor got, and the viewer's
    step prompts and the SFT export show it as sent; its coaching calls go to the coach's own
    model (the actor is the expert, the coach a random policy) and are listed with their prompt
    and answer; its role takes backend options while registered; nothing under experiments/
    names the arm, its role or its purpose."""
    run_dir = tmp_path / "coached"
    with registered(coached_arm()):
        assert "coach" in model_roles()
        args = [
            "run", "--agent", "coached", "--model", "scripted:expert", "--data",
            str(generated_games), "--split", SPLIT, "--games", "2", "--trials", "1",
            "--coach-model", "scripted:random", "--role-option", "coach.chat_format=user",
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        assert main(args) == 0
        with RunReader(run_dir) as reader:
            episodes = reader.episodes()
            assert len(episodes) == 2 and all(e.won for e in episodes)
            records = sft_records(reader)
            for episode in episodes:
                steps = reader.steps(episode.episode_id)
                calls = reader.model_calls(episode.episode_id)
                acts = [c for c in calls if c.purpose == "act"]
                assert len(acts) == len(steps) > 1
                for k, call in enumerate(acts):
                    assert call.sent is not None and call.sent.params["policy"] == "scripted:expert"
                    assert call.sent.prompt is not None and "coach-line: " in call.sent.prompt
                    shown = step_prompt(reader, episode, steps, k)
                    assert not shown.rebuilt and shown.sent.prompt == call.sent.prompt
                (coaching,) = [c for c in calls if c.purpose == "coaching"]
                assert coaching.sent is not None
                assert coaching.sent.params["policy"] == "scripted:random"  # the coach's own
                assert coaching.sent.messages  # its role's option: chat messages
                detail = episode_detail(reader, episode, steps)
                (listed,) = [c for c in detail["calls"] if c["purpose"] == "coaching"]
                assert listed["answer"] == coaching.answer and "Coach me on" in str(
                    listed["messages"]
                )
            exported = "\n".join(m["content"] for r in records for m in r.messages)
            assert len(records) >= 2 and exported.count("coach-line: ") >= sum(
                len(reader.steps(e.episode_id)) for e in episodes
            )
    assert "coach" not in model_roles()
    root = Path(__file__).resolve().parent.parent.parent
    named = [
        str(path.relative_to(root))
        for path in (root / "experiments").rglob("*")
        if path.is_file() and path.suffix in (".py", ".yaml", ".txt", ".json", ".md", ".html", ".js")
        and any(w in path.read_text(errors="replace") for w in ("coached", "coach", "coaching"))
    ]  # fmt: skip
    assert named == []
