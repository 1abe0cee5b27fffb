"""Golden tests: the rendered actor and reflection prompts are pinned, per task type.

Regenerate after an intended change with REFLEXSIM_UPDATE_GOLDEN=1 and review the diff.
"""

import json
import os
from pathlib import Path

import pytest

from agents.llm.markers import MEMORY_MARKER
from agents.prompting import (
    TASK_TYPES,
    _packaged_examples,
    actor_prefix,
    actor_prompt,
    example_texts,
    load_original_prompts,
    parse_judge,
    reflection_prompt,
)
from memory import ExplorationFact, Reflection

GOLDEN = Path(__file__).resolve().parents[1] / "support" / "golden"
UPDATE = os.environ.get("REFLEXSIM_UPDATE_GOLDEN") == "1"

# A made-up current game per task type (not an evaluation game): its first observation and a
# short history.
OBS = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a desk 1, a drawer 1, a fridge 1, a microwave 1, a shelf 1, and a sinkbasin 1.\nYour task is to: {task}"
TASKS = {
    "put": "put a pen in drawer.",
    "clean": "clean some cloth and put it in cabinet.",
    "heat": "heat some potato and put it in countertop.",
    "cool": "cool some apple and put it in countertop.",
    "examine": "look at book under the desklamp.",
    "puttwo": "put two pen in shelf.",
}
HISTORY = [
    ("think: I need to look around.", "OK."),
    ("go to desk 1", "You arrive at desk 1. On the desk 1, you see a pen 1."),
]
REFLECTIONS = [
    Reflection(
        task="g",
        trial=0,
        episode_id="g#t0",
        model="m",
        prompt_hash="h",
        text="I looped on the drawer. Next time I will open it first.",
    ),
    Reflection(
        task="g",
        trial=1,
        episode_id="g#t1",
        model="m",
        prompt_hash="h",
        text="I never checked shelf 1. I will go to shelf 1 first.",
    ),
]
FACTS = [
    ExplorationFact(place="drawer 1", contents=(), trial=0, opened=True),
    ExplorationFact(place="desk 1", contents=("pen 1", "lamp 1"), trial=0),
]


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        if not UPDATE:
            pytest.fail(f"golden file {name} missing: run with REFLEXSIM_UPDATE_GOLDEN=1")
        path.write_text(text)
    assert text == path.read_text(), (
        f"{name} changed: rerun with REFLEXSIM_UPDATE_GOLDEN=1 if intended"
    )


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_actor_prompt_golden(task_type):
    obs = OBS.format(task=TASKS[task_type])
    plain = actor_prompt(actor_prefix(example_texts(task_type)), obs, HISTORY)
    check(f"actor_{task_type}.txt", plain)
    assert MEMORY_MARKER not in plain
    with_memory = actor_prompt(
        actor_prefix(example_texts(task_type), REFLECTIONS, FACTS), obs, HISTORY
    )
    check(f"actor_{task_type}_memory.txt", with_memory)
    assert MEMORY_MARKER in with_memory
    assert with_memory.endswith("\n>") and not with_memory.endswith("> ")


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_reflection_prompt_golden(task_type):
    check(
        f"reflection_{task_type}.txt", reflection_prompt(OBS.format(task=TASKS[task_type]), HISTORY)
    )


def test_prompt_is_append_only():
    prefix = actor_prefix(example_texts("put"), REFLECTIONS)
    obs = OBS.format(task=TASKS["put"])
    history: list[tuple[str, str]] = []
    prev = actor_prompt(prefix, obs, history)
    for action, o in HISTORY * 3:
        history.append((action, o))
        nxt = actor_prompt(prefix, obs, history)
        assert nxt.startswith(prev)
        prev = nxt


def test_examples_come_from_train_games_only():
    for family in ("alfworld",):
        for kind, examples in _packaged_examples(family).items():
            assert len(examples) >= 2, kind
            for e in examples:
                assert e.game.startswith("json_2.1.1/train/"), e.game
                text = e.text()
                assert "\n> put " not in text  # ALFWorld 0.4 syntax: move X to Y
                if kind != "examine":
                    assert "\n> move " in text


def test_original_prompt_file_loader(tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(
        json.dumps({"react_put_0": "A\n> go\nB\n", "react_put_1": "C", "react_clean_0": "only one"})
    )
    loaded = load_original_prompts(f)
    assert loaded == {"put": ("C", "A\n> go\nB")}
    assert example_texts("put", f) == ("C", "A\n> go\nB")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="no react_"):
        load_original_prompts(bad)


def test_parse_judge():
    assert parse_judge("SUCCESS: the mug is in the coffeemachine")[0] == "success"
    assert parse_judge(" failure - it looped")[0] == "failure"
    assert parse_judge("maybe?")[0] == "unclear"
    assert parse_judge("")[0] == "unclear"
