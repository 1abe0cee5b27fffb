"""The reflexion-code protocol: the prompts and action handling of the paper's code, byte for byte.

The golden files under ``golden/reflexion_code`` were written by the paper's own code
(``env_history.py``, ``generate_reflections.py`` and ``alfworld_trial.py``'s joins and log
format) from the synthetic wording files next to them (``prompts.json``, ``instruction.txt``,
``reflection_template.txt``, ``reflection_examples.txt``; same formats as the originals, words
of our own) and the episode in ``episode.json``. Nothing here regenerates them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agents import reflexion_code as code
from agents.episode import EpisodeSpec
from agents.evaluators import CodeEvaluator
from agents.llm.base import Completion, GenerationConfig, Request
from agents.parsing import GroundingRules
from agents.react import ActorSettings, ReActAgent
from agents.reflexion import ReflexionSettings, prompt_prefix, reflect
from experiments.arming import code_prompts, prompt_file_hashes
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.session import run
from experiments.store import RunStore
from memory.records import EnvReply, Reflection, Step
from tests.support.gameruns import game_run

GOLDEN = Path(__file__).resolve().parents[1] / "support" / "golden" / "reflexion_code"
EPISODE = json.loads((GOLDEN / "episode.json").read_text())
OBS: str = EPISODE["observation"]
PAIRS: list[tuple[str, str]] = [(a, o) for a, o in EPISODE["steps"]]
TEXTS: list[str] = EPISODE["reflections"]


def files() -> dict[str, str]:
    return {
        "prompts": str(GOLDEN / "prompts.json"),
        "instruction_file": str(GOLDEN / "instruction.txt"),
        "reflection_template": str(GOLDEN / "reflection_template.txt"),
        "reflection_examples": str(GOLDEN / "reflection_examples.txt"),
    }


def prompts() -> code.CodePrompts:
    f = files()
    return code.CodePrompts.load(
        f["prompts"], f["instruction_file"], f["reflection_template"], f["reflection_examples"]
    )


def settings(**kw: Any) -> ReflexionSettings:
    return ReflexionSettings(3, "m", layout=code.CodeLayout(prompts()), **kw)


def reflections(n: int) -> list[Reflection]:
    return [Reflection("g", i, f"g#t{i}", "m", "h", TEXTS[i]) for i in range(n)]


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def steps_of(pairs: list[tuple[str, str]]) -> list[Step]:
    return [Step(index=i, kind="act", raw_output=a, action=a, observation=o) for i, (a, o) in enumerate(pairs)]  # fmt: skip


@pytest.mark.parametrize("trial", [0, 4])
@pytest.mark.parametrize("step", [0, 1, 5])
def test_actor_prompts_equal_the_paper_codes(trial, step):
    from agents.reflexion import visible_reflections

    shown = visible_reflections(reflections(trial), "g", trial, 3)  # trial 4: Trial 0/1/2
    prefix = prompt_prefix(settings(), "put", shown)
    prompt = code.actor_prompt(prefix, OBS, PAIRS[:step])
    assert prompt == golden(f"actor_trial{trial}_step{step}.txt")
    if step:
        assert prompt.endswith(PAIRS[step - 1][1] + ">")


class _Model:
    def __init__(self, text: str) -> None:
        self.text = text
        self.requests: list[Request] = []

    async def generate(self, request: Request) -> Completion:
        self.requests.append(request)
        return Completion(self.text, prompt_tokens=7, completion_tokens=3)


@pytest.mark.parametrize(
    ("name", "past", "summary"),
    [
        ("reflection_trial0.txt", 0, None),
        ("reflection_trial1.txt", 1, None),
        ("reflection_trial4_last.txt", 4, code.TrialSummary(successes=1, additional=1, total=3)),
    ],
)
def test_reflection_prompts_equal_the_paper_codes(name, past, summary):
    model = _Model("  A plan, kept as written.\n")
    window = reflections(past)[-3:]
    made = asyncio.run(
        reflect(
            model, settings(), task="g", trial=past, episode_id="e", observation=OBS,
            steps=steps_of(PAIRS), past=window, summary=summary,
        )
    )  # fmt: skip
    (request,) = model.requests
    assert request.prompt == golden(name)
    assert request.config.stop == () and request.config.temperature == 0.0
    assert request.config.max_tokens == 256
    assert made.reflection.text == "  A plan, kept as written.\n"


@dataclass
class _Ctx:
    """An episode context with scripted model texts (per call) and a recording env."""

    outputs: list[str]
    spec: EpisodeSpec = field(
        default_factory=lambda: EpisodeSpec("e", "g", "put", 0, prompt_prefix(settings(), "put"))
    )
    requests: list[Request] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    async def reset(self, replay: Any = ()) -> EnvReply:
        return EnvReply(OBS, info={"admissible_commands": ["look"]})

    async def step(self, action: str) -> EnvReply:
        self.sent.append(action)
        return EnvReply("Nothing happens.", info={"admissible_commands": ["look"]})

    async def generate(self, request: Request) -> Completion:
        self.requests.append(request)
        return Completion(self.outputs.pop(0), prompt_tokens=10, completion_tokens=2)

    def record(self, step: Step) -> None:
        self.steps.append(step)


def agent(max_steps: int = 49) -> ReActAgent:
    return ReActAgent(
        ActorSettings(
            generation=GenerationConfig(temperature=0.0, max_tokens=256, stop=("\n",)),
            evaluator=CodeEvaluator(exact=True),
            grounding=GroundingRules.none(),  # what the runner gives this protocol by default
            max_steps=max_steps,
            layout=code.CodeLayout(prompts()),
        )
    )


def test_actions_reach_the_env_exactly_as_the_model_wrote_them():
    written = [
        " Think: upper case ", " > inventory", " Inventory", " go  to  desk 1",
        " put pen 1 in/on drawer 1", "think: a thought\nmore", " think: a thought",
    ]  # fmt: skip
    ctx = _Ctx(list(written))
    end = asyncio.run(agent().play(ctx))
    assert ctx.sent == [
        "Think: upper case", "> inventory", "Inventory", "go  to  desk 1",
        "put pen 1 in/on drawer 1", "think: a thought", "think: a thought",
    ]  # fmt: skip
    # only a lower-case think: is a thought (the env still got it); the repeat ends the episode
    assert [s.observation for s in ctx.steps] == ["Nothing happens."] * 5 + ["OK.", "OK."]
    assert [s.kind for s in ctx.steps][-2:] == ["think", "think"]
    assert not end.won and "twice in a row" in (end.verdict or "")
    assert ctx.requests[-1].prompt == code.actor_prompt(
        ctx.spec.prefix, OBS, [(s.action, s.observation) for s in ctx.steps[:-1]]
    )


def test_short_outputs_are_asked_again_then_the_empty_action_is_played():
    ctx = _Ctx(
        [" go to desk 1", "ab", " ", "look\n", "  abcd ", "x", "", "a", "bcd", " go to desk 2"]
    )
    asyncio.run(agent(max_steps=3).play(ctx))
    temps = [r.config.temperature for r in ctx.requests]
    assert temps == [0.0, 0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0, 0.0, 0.2, 0.4]
    assert all(r.purpose == "act" for r in ctx.requests)  # each try a recorded model call
    assert ctx.sent == ["go to desk 1", "", "go to desk 2"]
    _, empty, last = ctx.steps
    assert (empty.kind, empty.action, empty.raw_output) == ("invalid", "", "")
    assert empty.prompt_tokens == 60 and empty.completion_tokens == 12  # six calls counted
    assert last.prompt_tokens == 30
    assert ctx.requests[7].prompt.endswith("\n> \nNothing happens.>")


def test_an_empty_first_action_is_exhausted_at_once():
    ctx = _Ctx([""] * 6)
    end = asyncio.run(agent().play(ctx))
    assert ctx.sent == [""] and "twice in a row" in (end.verdict or "")
    exact = CodeEvaluator(exact=True)
    assert exact.check(steps_of([("a", "o"), ("a", "p")])) and exact.check(steps_of([("", "o")]))
    assert not exact.check(steps_of([("a", "o"), ("b", "o")]))


def test_old_arrival_text_is_cut_as_the_code_cuts_it():
    assert code.step_observation("You arrive at loc 8. On the desk 1, you see a pen 1.") == (
        "On the desk 1, you see a pen 1."
    )
    assert code.step_observation("You arrive at desk 1.") == "You arrive at desk 1."


def test_the_protocol_needs_its_files_and_records_their_hashes(tmp_path):
    cfg = RunConfig.of(protocol="reflexion-code", prompts=files()["prompts"])
    with pytest.raises(ConfigError, match="--instruction-file, --reflection-template"):
        code_prompts(cfg)
    with pytest.raises(ConfigError, match="read only by --protocol reflexion-code"):
        RunConfig.of(reflection_template="t.txt")
    bad = tmp_path / "t.txt"
    bad.write_text("no placeholders\n")
    with pytest.raises(ConfigError, match="no {trajectory} placeholder"):
        code_prompts(RunConfig.of(protocol="reflexion-code", **{**files(), "reflection_template": str(bad)}))  # fmt: skip
    with pytest.raises(ConfigError, match="--action-decoding free"):
        code_prompts(RunConfig.of(protocol="reflexion-code", action_decoding="nearest", **files()))
    hashes = prompt_file_hashes(RunConfig.of(protocol="reflexion-code", **files()))
    assert set(hashes) == {*files(), "layout"}


def test_both_protocols_get_the_same_observations_for_the_same_commands(generated_games, tmp_path):
    runs = {}
    for name, kw in (("own", {}), ("code", {"protocol": "reflexion-code", **files()})):
        cfg = game_run(
            generated_games, tmp_path, name, "reflexion", model="scripted:expert", games=2,
            evaluator="code", max_steps=49, **kw,
        )  # fmt: skip
        store = RunStore(run(cfg), readonly=True)
        runs[name] = {
            (e.game, e.trial): (e.observation, [(s.action, s.observation) for s in store.steps(e.episode_id)])
            for e in store.episodes()
        }  # fmt: skip
        manifest = store.get_meta("manifest")
        assert manifest["protocol"] == cfg.protocol.protocol
        store.close()
    assert runs["own"].keys() == runs["code"].keys()
    compared = 0
    for key, (first, steps) in runs["own"].items():
        code_first, code_steps = runs["code"][key]
        assert first == code_first and "\n\n" not in first  # one newline before the task line
        assert len(steps) == len(code_steps)
        for (action, obs), (code_action, code_obs) in zip(steps, code_steps, strict=True):
            if action == code_action and not action.startswith("think:"):
                assert obs == code_obs
                compared += 1
    assert compared
    assert manifest["prompt_files"].keys() == {*files(), "layout"}


def test_the_paper_original_preset_sets_what_the_code_sets():
    from experiments import matrix

    preset = matrix.load_preset("paper-original")
    (job,) = preset.jobs
    cfg = matrix.job_config(preset, job, {}, Path("runs")).to_dict()
    assert cfg["protocol"] == "reflexion-code" and cfg["agent"] == "reflexion"
    assert (cfg["max_steps"], cfg["evaluator"], cfg["memory_size"], cfg["trials"]) == (
        49,
        "code",
        3,
        10,
    )
    assert (cfg["max_tokens"], cfg["reflect_max_tokens"], cfg["temperature"]) == (256, 256, 0.0)
    assert cfg["grounding"] is False and cfg["count_thoughts"] is True
    assert "--reflection-template" in preset.description


def test_the_protocol_plays_the_code_arms_only_and_needs_every_task_type(generated_games, tmp_path):
    with pytest.raises(ConfigError, match="--agent react or reflexion"):
        RunConfig.of(protocol="reflexion-code", agent="lats")
    only_put = tmp_path / "put.json"
    data = json.loads((GOLDEN / "prompts.json").read_text())
    only_put.write_text(json.dumps({k: v for k, v in data.items() if "_put_" in k}))
    cfg = game_run(
        generated_games, tmp_path, "r", "reflexion", model="scripted:expert",
        protocol="reflexion-code", **{**files(), "prompts": str(only_put)},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="has no react_"):
        run(cfg)


def test_put_becomes_move_only_when_asked():
    from dataclasses import replace

    from experiments.arming import actor_settings

    plain = actor_settings(RunConfig.of(protocol="reflexion-code", **files()))
    assert plain.grounding == GroundingRules.none()
    assert isinstance(plain.layout, code.CodeLayout) and not plain.layout.code_put_to_move
    asked = actor_settings(
        RunConfig.of(protocol="reflexion-code", code_put_to_move=True, **files())
    )
    assert asked.grounding == GroundingRules.none()
    assert isinstance(asked.layout, code.CodeLayout) and asked.layout.code_put_to_move
    with pytest.raises(ConfigError, match="read only by --protocol reflexion-code"):
        RunConfig.of(code_put_to_move=True)
    moving = agent()
    moving.settings = replace(
        moving.settings, layout=code.CodeLayout(prompts(), code_put_to_move=True)
    )
    ctx = _Ctx(
        [" put pen 1 in/on drawer 1", " Put pen 1 in/on drawer 1", " Put pen 1 in/on drawer 1"]
    )
    asyncio.run(moving.play(ctx))
    assert ctx.sent == [
        "move pen 1 to drawer 1",
        "Put pen 1 in/on drawer 1",
        "Put pen 1 in/on drawer 1",
    ]
    assert "\n> move pen 1 to drawer 1\n" in ctx.requests[-1].prompt
