"""``reflexsim games stats``: figures counted from game files, real and generated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envs.alfgen.stats import (
    SHORT_TYPES,
    GameFacts,
    distances,
    read_game,
    read_games,
    summarize,
    train_combo_counts,
    train_reference,
    tv_distance,
)
from envs.discovery import SPLITS
from envs.errors import EnvError

ROOT = Path(__file__).resolve().parent.parent.parent

PROBLEM = """
(define (problem plan_trial_x)
(:domain alfred)
(:objects
agent1 - agent
        Apple_bar__plus_01_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 - object
        Apple_bar__plus_02_dot_00_bar__plus_00_dot_10_bar__plus_00_dot_50 - object
        Mug_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 - object
        Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_50 - receptacle
        CounterTop_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 - receptacle
        CoffeeMachine_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_40 - receptacle
        )
(:init
        (receptacleType Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_50 FridgeType)
        (receptacleType CounterTop_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 CounterTopType)
        (receptacleType CoffeeMachine_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_40 CoffeeMachineType)
        (objectType Apple_bar__plus_01_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 AppleType)
        (objectType Apple_bar__plus_02_dot_00_bar__plus_00_dot_10_bar__plus_00_dot_50 AppleType)
        (objectType Mug_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 MugType)
        (openable Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_50)
        (inReceptacle Apple_bar__plus_01_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_50)
        (inReceptacle Mug_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 CoffeeMachine_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_40)
        (inReceptacle Mug_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50 CounterTop_bar__plus_03_dot_00_bar__plus_00_dot_90_bar__plus_00_dot_50)
        )
(:goal (and))
)
"""


def write(root: Path, folder: str, walkthrough: list[str]) -> Path:
    trial = root / "json_2.1.1" / "train" / folder / "trial_T0_0000"
    trial.mkdir(parents=True)
    game = trial / "game.tw-pddl"
    game.write_text(json.dumps({"pddl_problem": PROBLEM, "walkthrough": walkthrough}))
    return game


def test_one_game_is_counted_from_its_init_facts(tmp_path):
    apple = write(tmp_path, "pick_heat_then_place_in_recep-Apple-None-CounterTop-7", ["a"] * 6)
    facts = read_game(apple, tmp_path)
    assert facts == GameFacts(
        game_id="json_2.1.1/train/pick_heat_then_place_in_recep-Apple-None-CounterTop-7/trial_T0_0000",
        task_type="heat",
        target="Apple",
        mrecep="None",
        parent="CounterTop",
        scene=7,
        receptacles=3,
        target_copies=2,  # the one on the floor counts
        behind_closed_door=True,
        in_goal_type=False,
        walkthrough=6,
    )
    assert facts.room == "kitchen" and facts.combo == ("heat", "Apple", "None", "CounterTop")
    # An object in two receptacles (a mug in a coffee machine on a counter) starts in both.
    mug = write(tmp_path, "pick_cool_then_place_in_recep-Mug-None-CounterTop-7", ["a"] * 4)
    facts = read_game(mug, tmp_path)
    assert facts.in_goal_type and not facts.behind_closed_door and facts.target_copies == 1


def test_summary_shares_and_distances(tmp_path):
    write(tmp_path, "pick_heat_then_place_in_recep-Apple-None-CounterTop-7", ["a"] * 6)
    write(tmp_path, "pick_heat_then_place_in_recep-Mug-None-CounterTop-7", ["a"] * 4)
    stats = summarize(read_games(tmp_path))
    assert stats.games == 2 and stats.games_by_type == {"heat": 2}
    assert stats.closed["heat"] == 0.5 and stats.goal["heat"] == 0.5
    assert stats.walkthrough["heat"] == {6: 1.0, 4: 1.0}
    assert stats.rooms["heat"] == {"kitchen": 2.0}
    assert stats.mean_receptacles == 3.0
    train = train_reference()
    combos = train_combo_counts()
    assert ("heat", "Apple", "None", "CounterTop") in combos
    assert ("heat", "Mug", "None", "CounterTop") not in combos
    assert stats.combos_in_train == 0.5
    d = distances(stats, train)
    assert d["closed:heat"] == pytest.approx(abs(0.5 - train.closed["heat"]))
    assert d["rooms:heat"] == 0.0  # heat games are all in kitchens, as in the train split
    assert set(d) == {"receptacles"} | {
        f"{f}:heat" for f in ("rooms", "copies", "closed", "goal", "walkthrough")
    }


def test_tv_distance():
    assert tv_distance({"a": 1}, {"a": 5}) == 0.0
    assert tv_distance({"a": 1}, {"b": 2}) == 1.0
    assert tv_distance({1: 1, 2: 1}, {1: 3, 2: 1}) == pytest.approx(0.25)


def test_train_reference_is_the_train_split():
    train = train_reference()
    assert train.games == 3553 == sum(train.games_by_type.values())
    assert set(train.games_by_type) == set(SHORT_TYPES)
    for t in SHORT_TYPES:
        assert sum(train.rooms[t].values()) == train.games_by_type[t]
        assert sum(train.walkthrough[t].values()) == train.games_by_type[t]
    assert sum(train.receptacles.values()) == pytest.approx(train.games)
    assert 22 < train.mean_receptacles < 25


def test_bad_folders_are_one_line_errors(tmp_path):
    with pytest.raises(EnvError, match="not a folder"):
        read_games(tmp_path / "missing")
    with pytest.raises(EnvError, match="no game.tw-pddl"):
        read_games(tmp_path)
    odd = tmp_path / "odd" / "trial" / "game.tw-pddl"
    odd.parent.mkdir(parents=True)
    odd.write_text("{}")
    with pytest.raises(EnvError, match="not an ALFWorld game file"):
        read_games(tmp_path)
    odd.write_text(json.dumps({"pddl_problem": PROBLEM}))
    with pytest.raises(EnvError, match="task folder named"):
        read_games(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "games", "stats", str(tmp_path / "missing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_cli_prints_the_known_counts_of_the_valid_seen_games(alfworld_data):
    folder = alfworld_data / SPLITS["eval_in_distribution"]
    if len(list(folder.glob("*/*/game.tw-pddl"))) != 140:
        pytest.skip("not the full valid_seen split")
    r = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "games", "stats", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert ["games", "140", "3553"] in rows
    for t, n in {
        "put": 35,
        "clean": 27,
        "heat": 16,
        "cool": 25,
        "examine": 13,
        "puttwo": 24,
    }.items():
        assert any(row[:2] == [t, str(n)] for row in rows), t
    assert any(row[:5] == ["receptacles", "per", "room,", "mean", "24.4"] for row in rows)
    assert any(row[:5] == ["combination", "in", "train", "split", "99.3%"] for row in rows)
    closed = [row[4] for row in rows if row[:4] == ["behind", "a", "closed", "door"]]
    # put clean heat cool examine puttwo (the 23% overall: 32 of 140)
    assert closed == ["25.7%", "29.6%", "50.0%", "8.0%", "7.7%", "16.7%"]
    goal = [row[4] for row in rows if row[:4] == ["in", "a", "goal-type", "receptacle"]]
    assert goal == ["0.0%", "48.1%", "62.5%", "48.0%", "0.0%", "0.0%"]
