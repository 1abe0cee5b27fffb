"""The offline ALFWorld game generator: real planner, real engine, real files.

One game per task type is generated once per module (seed 0) and shared by the tests; the
determinism test generates the same six again into a second folder and compares bytes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from envs.alfgen import UNSEEN_EVAL_SCENES, generate
from envs.alfgen.generator import GameMaker, scenes_for, stream
from envs.alfgen.pddl import mangle, render_problem
from envs.alfgen.scenes import FLOOR_OBJECTS, load_scene
from envs.alfgen.stats import (
    distances,
    game_facts,
    summarize,
    train_reference,
    train_scene_receptacles,
)
from envs.alfgen.tasks import controls_for, sample_task, shortest_plan
from envs.alfworld_env import ALFWorldEnv
from envs.discovery import SPLITS, TASK_TYPES
from envs.errors import EnvError
from tests.support.walkthroughs import walkthrough_of

ROOT = Path(__file__).resolve().parent.parent.parent
SHARED_DATA = ROOT.parent / "shared" / "alfworld_data"
SEED = 0
TASK_LINE = re.compile(r'"rhs": "Your task is to: (.*?)"')


def real_data() -> Path | None:
    value = os.environ.get("ALFWORLD_DATA")
    for root in ([Path(value)] if value else []) + [SHARED_DATA]:
        if (root / "json_2.1.1").is_dir() and any((root / "json_2.1.1").glob("*/*/*/game.tw-pddl")):
            return root
    return None


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("gen_a")
    argv, data_env = list(sys.argv), os.environ.get("ALFWORLD_DATA")
    paths = generate(root, per_type=1, seed=SEED)
    # The engine's translator rewrites sys.argv and importing alfworld sets $ALFWORLD_DATA:
    # generate() must leave the process as it found it.
    assert sys.argv == argv
    assert os.environ.get("ALFWORLD_DATA") == data_env
    return root, paths


def template_of(sentence: str, folder: str) -> str:
    """'put a clean mug in coffeemachine.' -> 'put a clean {obj} in {recep}.' (names from the folder)."""
    _, obj, _, recep, _ = folder.split("-")
    return sentence.replace(obj.lower(), "{obj}").replace(recep.lower(), "{recep}")


# -- 1. all six task types, each won by its stored walkthrough through ALFWorldEnv ------------
def test_all_six_types_in_alfworld_layout_and_won_by_walkthrough(games):
    root, paths = games
    assert len(paths) == 6
    kinds = set()
    for path in paths:
        rel = path.relative_to(root).parts
        assert rel[:2] == tuple(SPLITS["train"].split("/"))
        assert rel[3].startswith("trial_T") and rel[4] == "game.tw-pddl"
        task_type, obj, mrecep, recep, scene = rel[2].split("-")
        assert mrecep == "None" and obj and recep and scene.isdigit()
        traj = json.loads((path.parent / "traj_data.json").read_text())
        assert traj["task_type"] == task_type
        data = json.loads(path.read_text())
        assert data["solvable"] is True and data["walkthrough"]
        kinds.add(task_type)
    assert kinds == set(TASK_TYPES)

    assert_walkthroughs_win(root, "train")


def assert_walkthroughs_win(root: Path, split: str) -> None:
    env = ALFWorldEnv(data_dir=root, split=split, max_steps=50)
    assert len(env.game_ids) == 6
    for game_id in env.game_ids:
        obs, info = env.reset(options={"game": game_id})
        assert obs.startswith("You are in the middle of a room.")
        assert not info["won"]
        for command in walkthrough_of(info):
            assert command in info["admissible_commands"], (game_id, command)
            obs, reward, terminated, truncated, info = env.step(command)
        assert info["won"] and terminated and reward == 1.0, game_id
    env.close()


def test_ood_games_are_in_the_unseen_rooms_and_won_by_walkthrough(generated_games):
    env = ALFWorldEnv(data_dir=generated_games, split="eval_out_of_distribution")
    ids = env.game_ids
    env.close()
    assert {game_id.split("/")[2].split("-")[0] for game_id in ids} == set(TASK_TYPES)
    assert {int(game_id.split("/")[2].split("-")[-1]) for game_id in ids} <= set(UNSEEN_EVAL_SCENES)
    assert_walkthroughs_win(generated_games, "eval_out_of_distribution")


# -- 2. determinism ------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_same_seed_writes_identical_bytes(games, tmp_path):
    root, _ = games
    # A fresh process with another hash seed: no set or dict order may leak into the files.
    code = f"from envs.alfgen import generate; generate({str(tmp_path)!r}, per_type=1, seed={SEED})"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = _tree(root), _tree(tmp_path)
    assert list(first) == list(second)
    assert first == second


def test_different_seed_gives_different_games(games, tmp_path):
    root, _ = games
    paths = generate(tmp_path, per_type=1, seed=SEED + 1, task_types=["put"])
    ours = [p for p in _tree(root) if "/pick_and_place_simple-" in p and p.endswith("game.tw-pddl")]
    assert len(paths) == 1 and len(ours) == 1
    other = json.loads(paths[0].read_text())
    mine = json.loads((root / ours[0]).read_text())
    assert paths[0].parent.name != Path(ours[0]).parent.name
    assert other["pddl_problem"] != mine["pddl_problem"]


def test_game_index_does_not_depend_on_per_type(games, tmp_path):
    root, _ = games
    paths = generate(tmp_path, per_type=2, seed=SEED, task_types=["examine"])
    first = paths[0].relative_to(tmp_path).as_posix()
    assert (root / first).read_bytes() == paths[0].read_bytes()


# -- 4. task sentences read like ALFWorld's ---------------------------------------------------
def test_sentences_use_the_real_games_templates(games):
    data = real_data()
    if data is None:
        pytest.skip("real ALFWorld games not present (set $ALFWORLD_DATA)")
    real: dict[str, set[str]] = {}
    for f in sorted((data / "json_2.1.1").glob("*/*/*/game.tw-pddl")):
        folder = f.parent.parent.name
        match = TASK_LINE.search(json.loads(f.read_text())["grammar"])
        if match and folder.count("-") == 4:
            real.setdefault(folder.split("-")[0], set()).add(template_of(match.group(1), folder))
    root, paths = games
    env = ALFWorldEnv(data_dir=root, split="train")
    for game_id in env.game_ids:
        folder = game_id.split("/")[2]
        _, info = env.reset(options={"game": game_id})
        task_type = folder.split("-")[0]
        assert template_of(info["task"], folder) in real[task_type], (folder, info["task"])
    env.close()


def test_domain_and_grammar_are_the_released_games_own(games):
    data = real_data()
    if data is None:
        pytest.skip("real ALFWorld games not present (set $ALFWORLD_DATA)")
    real_file = sorted((data / "json_2.1.1").glob("*/*/*/game.tw-pddl"))[0]
    real = json.loads(real_file.read_text())
    real_task = TASK_LINE.search(real["grammar"]).group(1)  # type: ignore[union-attr]
    _, paths = games
    for path in paths:
        ours = json.loads(path.read_text())
        assert ours["pddl_domain"] == real["pddl_domain"]
        our_task = TASK_LINE.search(ours["grammar"]).group(1)  # type: ignore[union-attr]
        assert ours["grammar"].replace(our_task, real_task) == real["grammar"]


def test_problems_have_the_real_form(games):
    _, paths = games
    for path in paths:
        problem = json.loads(path.read_text())["pddl_problem"]
        assert "(:domain alfred)" in problem and "(:goal" in problem
        for pred in ("receptacleType", "objectType", "canContain", "pickupable", "inReceptacle"):
            assert f"({pred} " in problem
        assert "(opened " not in problem  # every openable receptacle starts closed
        init = problem.split("(:init")[1].split("(:goal")[0]
        ids = re.findall(r"\(objectType (\S+) \w+Type\)", init)
        assert ids
        assert all(
            re.fullmatch(r"[A-Za-z]+(_bar_(_minus_|_plus_)?\d\d_dot_\d\d){3}", i) for i in ids
        ), ids[:3]


# -- scenes per split: no train game in an OOD-evaluation room ------------------------------------
def test_splits_keep_ood_rooms_apart():
    for task_type in TASK_TYPES:
        train = set(scenes_for("train", task_type))
        ood = set(scenes_for("eval_out_of_distribution", task_type))
        assert train and ood, task_type
        assert not train & set(UNSEEN_EVAL_SCENES)
        assert ood <= set(UNSEEN_EVAL_SCENES)


# -- 6. drawn from ALFWorld's train split ----------------------------------------------------------
def test_train_rooms_have_the_train_splits_receptacles():
    for number, wanted in sorted(train_scene_receptacles().items()):
        scene = load_scene(number)
        assert scene.complete
        assert dict(Counter(r.rtype for r in scene.receptacles)) == wanted, number
        assert len({r.rid for r in scene.receptacles}) == len(scene.receptacles)
    # The layouts list the cabinets with doors; the train games' extra ones are doorless.
    kitchen = load_scene(17)
    cabinets = kitchen.of_type("Cabinet")
    assert len(cabinets) == 20 and 0 < sum(r.openable for r in cabinets) < 20
    assert not load_scene(UNSEEN_EVAL_SCENES[0]).complete


def test_fixed_objects_stay_put_and_floor_objects_lie_on_the_floor():
    scene = load_scene(301)  # a bedroom with a desk lamp, a basketball and a baseball bat
    lamp = scene.fixture("DeskLamp")
    assert lamp is not None and len(lamp.receptacles) == 1
    floor = [p for p in scene.fixed if p.otype in FLOOR_OBJECTS]
    assert {p.otype for p in floor} >= {"BasketBall", "BaseballBat"}
    controls = controls_for(0, "look_at_obj_in_light", 0)
    tasks = []
    for k in range(2):
        rng = stream(k, "look_at_obj_in_light", 0, 0)
        tasks.append(sample_task(scene, "look_at_obj_in_light", rng, controls))
    for task in tasks:
        assert lamp in task.objects  # same id, same receptacle in every game of the room
        problem = render_problem(task, "t")
        for p in floor:
            assert f"(inReceptacle {mangle(p.oid)} " not in problem
            assert f"(objectAtLocation {mangle(p.oid)} " in problem
    assert tasks[0].objects != tasks[1].objects


def test_drawn_tasks_follow_the_train_split():
    """30 games per type, before planning: every figure within 0.1 of the train split's (the
    walkthrough lengths as :func:`shortest_plan` counts them; the next test checks it)."""
    facts = []
    with GameMaker("train") as maker:
        for task_type in TASK_TYPES:
            for index in range(30):
                _, task, _ = next(maker.drafts(task_type, SEED, index))
                problem = render_problem(task, "t")
                facts.append(game_facts(task.folder_name, problem, shortest_plan(task)))
    stats = summarize(facts)
    assert stats.combos_in_train == 1.0
    far = {k: round(v, 3) for k, v in distances(stats, train_reference()).items() if v > 0.1}
    assert not far


def test_shortest_plan_is_the_planners_walkthrough_length():
    with GameMaker("train") as maker:
        for task_type in TASK_TYPES:
            for index in range(2):
                _, task, length = next(maker.drafts(task_type, SEED + 5, index))
                walkthrough = maker.planner().plan(render_problem(task, "t", planning=True))
                assert len(walkthrough) == shortest_plan(task), (task.folder_name, walkthrough)
                assert length in (0, len(walkthrough))


# -- 5. bad arguments: one-line EnvError, CLI exit code 2 -------------------------------------
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"per_type": 0}, "per_type"),
        ({"per_type": -3}, "per_type"),
        ({"task_types": ["juggle"]}, "unknown task type"),
        ({"task_types": []}, "task_types is empty"),
        ({"seed": -1}, "seed"),
        ({"split": "valid_unseen"}, "unknown split"),
    ],
)
def test_bad_arguments_raise_one_line_env_errors(tmp_path, kwargs, needle):
    args = {"per_type": 1, "seed": 0, **kwargs}
    with pytest.raises(EnvError) as err:
        generate(tmp_path / "out", **args)  # type: ignore[arg-type]
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written on bad arguments


def test_unwritable_out_dir_is_an_env_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for out in (blocker, blocker / "below"):
        with pytest.raises(EnvError) as err:
            generate(out, per_type=1, seed=0)
        assert str(out) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [["--per-type", "0"], ["--task-types", "juggle"], ["--split", "nope"]],
)
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path, extra):
    cmd = [
        sys.executable,
        "-m",
        "experiments.cli",
        "games",
        "generate",
        "--out",
        str(tmp_path),
        *extra,
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reflexsim: error: "), r.stderr
    assert "Traceback" not in r.stderr


def test_cli_generates_games_env_can_load(tmp_path):
    cmd = [sys.executable, "-m", "experiments.cli", "games", "generate", "--out", str(tmp_path)]
    cmd += ["--per-type", "1", "--seed", "3", "--task-types", "examine"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"wrote 1 games under {tmp_path}"
    env = ALFWorldEnv(data_dir=tmp_path, split="train", task_types=["examine"])
    assert len(env.game_ids) == 1 and "/look_at_obj_in_light-" in env.game_ids[0]


def test_importing_the_generator_stays_light():
    code = "import sys, envs.alfgen; print(sorted(m for m in sys.modules if m.split('.')[0] in ('alfworld', 'textworld', 'fast_downward')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
