"""ALFWorldEnv on the real engine and real game files (skipped when no games are present)."""

from __future__ import annotations

import json
import multiprocessing
import random
import shutil
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers reflexsim/ALFWorld-v0)
from envs.alfworld_env import ALFWorldEnv
from envs.discovery import SPLITS, TASK_TYPES, task_type_from_name
from envs.errors import EnvError, GameFileError
from envs.ground_truth import GameFileTruth
from tests.conftest import FULL_CHECKS, require_alfworld_data
from tests.support.walkthroughs import walkthrough_of

SPLIT = "eval_in_distribution"
# A full ALFWorld download has 3,553 train games: play an evenly spaced sample of them.
MAX_TRAIN_GAMES = 200
# CI plays a seeded sample of each split, this many games of each task type (every game of the
# split with REFLEXSIM_FULL_CHECKS=1): a game's first reset, its translation, is the cost.
PER_TASK_TYPE = 4


data_root = require_alfworld_data  # the real games, or the test is skipped


@pytest.fixture(scope="module")
def data() -> Path:
    return data_root()


@pytest.fixture(scope="module")
def small_games(data: Path) -> list[str]:
    """Three of the smallest valid_seen games (fast to load), with walkthroughs of >= 3 steps."""
    files = sorted((data / SPLITS[SPLIT]).glob("*/*/game.tw-pddl"), key=lambda f: f.stat().st_size)
    picked = []
    for f in files:
        if "movable" in str(f) or "Sliced" in str(f):
            continue
        game = json.loads(f.read_text())
        if game.get("solvable") and len(game.get("walkthrough") or ()) >= 3:
            picked.append(f.parent.relative_to(data).as_posix())
        if len(picked) == 3:
            return picked
    pytest.skip("fewer than 3 small games with walkthroughs")


def make(data: Path, games: list[str], **kwargs: object) -> ALFWorldEnv:
    return ALFWorldEnv(data_dir=data, split=SPLIT, games=games, **kwargs)  # type: ignore[arg-type]


# -- 1. every stored walkthrough wins its game -----------------------------------------------
def play_walkthroughs(data: Path, split: str, game_ids: list[str]) -> list[str]:
    """Each game's stored walkthrough (read through the ground-truth port) through one env: what
    went wrong, if anything. No reply of the env carries the walkthrough."""
    env = gym.make("reflexsim/ALFWorld-v0", data_dir=data, split=split, games=game_ids)
    failures = []
    for game_id in game_ids:
        obs, info = env.reset(options={"game": game_id})
        walkthrough = walkthrough_of(info)
        replies = [info]
        for i, action in enumerate(walkthrough):
            obs, reward, terminated, truncated, info = env.step(action)
            replies.append(info)
            last = i == len(walkthrough) - 1
            if (reward == 1.0, terminated, info["won"]) != (last, last, last) or truncated:
                failures.append(f"{game_id} step {i} {action!r}: {obs[:80]!r} r={reward}")
                break
        if any("walkthrough" in reply for reply in replies):
            failures.append(f"{game_id}: a reply's info carries the walkthrough")
        # every text came from the fast path (tests/envs/test_fast_text.py: it is TextWorld's text)
        if env.unwrapped.text_stats()["fallbacks"]:  # type: ignore[attr-defined]
            failures.append(f"{game_id}: some text was left to TextWorld's grammar")
    env.close()
    return failures


def per_task_type(game_ids: list[str], n: int, seed: int) -> list[str]:
    """A seeded sample of ``n`` games of each task type (all of a type that has fewer)."""
    by_type: dict[str, list[str]] = {}
    for game_id in game_ids:
        by_type.setdefault(str(task_type_from_name(Path(game_id).parent.name)), []).append(game_id)
    rng = random.Random(seed)
    picked = [g for ids in by_type.values() for g in rng.sample(ids, min(n, len(ids)))]
    return sorted(picked)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["eval_in_distribution", "train"])
def test_walkthroughs_win_every_game(data: Path, split: str) -> None:
    if not (data / SPLITS[split]).is_dir():
        pytest.skip(f"no {split} games under {data}")
    game_ids = ALFWorldEnv(data_dir=data, split=split).game_ids
    if split == "eval_in_distribution":
        assert len(game_ids) == 140  # the protocol's count for valid_seen
    if not FULL_CHECKS:
        game_ids = per_task_type(game_ids, PER_TASK_TYPE, seed=0)
        assert {task_type_from_name(Path(g).parent.name) for g in game_ids} == set(TASK_TYPES)
    elif len(game_ids) > MAX_TRAIN_GAMES:
        game_ids = game_ids[:: len(game_ids) // MAX_TRAIN_GAMES + 1]
    # two processes, half the games each (a game's first reset, its translation, is the cost)
    halves = [game_ids[0::2], game_ids[1::2]]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        failures = [
            f for part in pool.map(play_walkthroughs, [data] * 2, [split] * 2, halves) for f in part
        ]
    assert not failures, "\n".join(failures[:10])


# -- 2. Gymnasium's own checker ------------------------------------------------------------------
def test_check_env_passes(data: Path, small_games: list[str]) -> None:
    env = gym.make("reflexsim/ALFWorld-v0", data_dir=data, split=SPLIT, games=small_games[:1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    complaints = [str(w.message) for w in caught if "WARN" in str(w.message)]
    assert not complaints
    env.close()


# -- 3. observations and info as the protocol says -------------------------------------------
def test_reset_observation_and_info(data: Path, small_games: list[str]) -> None:
    env = make(data, small_games)
    game_id = small_games[0]
    obs, info = env.reset(options={"game": game_id})
    assert obs.startswith("You are in the middle of a room")
    assert "\nYour task is to: " in obs and "\n\n" not in obs  # as '\n'.join(ob.split('\n\n')[1:])
    assert "Welcome" not in obs and "-=" not in obs
    assert env.observation_space.contains(obs)
    assert info["task"] and obs.endswith("Your task is to: " + info["task"])
    assert info["game"] == game_id and not Path(info["game"]).is_absolute()
    assert (data / info["game"] / "game.tw-pddl").is_file()
    folder = Path(game_id).parent.name
    assert info["task_type"] == TASK_TYPES[str(task_type_from_name(folder))]
    assert info["task_type"] in {"put", "clean", "heat", "cool", "examine", "puttwo"}
    assert info["won"] is False
    assert info["max_steps"] == 50
    commands = info["admissible_commands"]
    assert commands and all(isinstance(c, str) for c in commands) and "look" in commands
    walkthrough = walkthrough_of(info)
    assert all(isinstance(a, str) for a in walkthrough)
    assert walkthrough[0] in commands


def test_no_reply_carries_the_walkthrough(data: Path, small_games: list[str]) -> None:
    """The walkthrough is ground truth, read from the game file through the port: no reset or
    step reply carries it, before or after the win."""
    env = make(data, small_games)
    for game_id in small_games[:2]:
        _, info = env.reset(options={"game": game_id})
        walkthrough = walkthrough_of(info)
        replies = [info] + [env.step(a)[4] for a in [*walkthrough, "look"]]
        assert replies[-2]["won"]
        for reply in replies:
            assert "walkthrough" not in reply and walkthrough not in reply.values()


def test_reward_only_on_the_winning_step(data: Path, small_games: list[str]) -> None:
    env = make(data, small_games)
    _, info = env.reset(options={"game": small_games[1]})
    walkthrough = walkthrough_of(info)
    actions = ["look", "dance wildly", *walkthrough]
    for i, action in enumerate(actions):
        obs, reward, terminated, truncated, info = env.step(action)
        last = i == len(actions) - 1
        assert reward == (1.0 if last else 0.0), (action, obs)
        assert terminated is last and info["won"] is last
        assert truncated is False
        assert env.observation_space.contains(obs)
    assert info["steps"] == len(actions)
    # an inadmissible command is an observation, not an error
    assert env.step("dance wildly")[0] == "Nothing happens."


def test_truncated_only_at_max_steps(data: Path, small_games: list[str]) -> None:
    game_id = small_games[0]
    env = make(data, small_games, max_steps=3)
    env.reset(options={"game": game_id})
    flags = [env.step("look")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    # winning on the last allowed step is a win, not a truncation
    truth = GameFileTruth("alfworld", {game_id: data / game_id / "game.tw-pddl"})
    walkthrough = truth.walkthrough(game_id) or []
    env = make(data, small_games, max_steps=len(walkthrough))
    env.reset(options={"game": game_id})
    flags = [env.step(a)[2:4] for a in walkthrough]
    assert flags == [(False, False)] * (len(walkthrough) - 1) + [(True, False)]


def test_seed_picks_a_game_deterministically(data: Path, small_games: list[str]) -> None:
    env = make(data, small_games)
    other = make(data, small_games)
    seen: dict[int, str] = {}
    for seed in range(12):
        if len(set(seen.values())) == 2:
            break
        obs, info = env.reset(seed=seed)
        seen[seed] = info["game"]
        again_obs, again = other.reset(seed=seed)
        assert (again["game"], again_obs) == (info["game"], obs)
    assert len(set(seen.values())) == 2, "seeds should spread over the games"
    first = next(iter(seen))
    assert env.reset(seed=first)[1]["game"] == seen[first]


def test_memory_stays_flat_across_games(data: Path, small_games: list[str]) -> None:
    """TextWorld interns every Proposition it builds; the env drops them on each load."""
    core = pytest.importorskip("mementos.core")
    env = make(data, small_games)

    def interned() -> int:
        return sum(
            1 for k in core._memento_cache if k and getattr(k[0], "__name__", "") == "Proposition"
        )

    env.reset(options={"game": small_games[0]})
    first = interned()
    for game_id in [*small_games[1:], small_games[0]]:
        env.reset(options={"game": game_id})
    assert interned() <= 1.5 * first


# -- 4. bad input: one clear line, our own exception types ----------------------------------
def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_missing_or_empty_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(data_dir=tmp_path / "nope", split=SPLIT)
    assert "does not exist" in one_line(exc)
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(data_dir=tmp_path, split=SPLIT)
    assert "not found" in one_line(exc) and str(tmp_path) in one_line(exc)
    (tmp_path / SPLITS[SPLIT]).mkdir(parents=True)
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(data_dir=tmp_path, split=SPLIT)
    assert "no solvable games" in one_line(exc)
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(split=SPLIT)
    assert "$ALFWORLD_DATA" in one_line(exc)
    with pytest.raises(EnvError):
        gym.make("reflexsim/ALFWorld-v0", data_dir=tmp_path / "nope")


def test_unknown_split_task_type_and_game(data: Path, small_games: list[str]) -> None:
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(data_dir=data, split="valid_seen")
    assert "unknown split" in one_line(exc) and "eval_in_distribution" in one_line(exc)
    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(data_dir=data, split=SPLIT, task_types=["juggle"])
    assert "unknown task type" in one_line(exc)
    with pytest.raises(EnvError) as exc:
        make(data, ["json_2.1.1/valid_seen/no-such-game/trial_T0"])
    assert "unknown game id" in one_line(exc)
    env = make(data, small_games)
    with pytest.raises(EnvError) as exc:
        env.reset(options={"game": "no-such-game"})
    assert "unknown game id" in one_line(exc)
    with pytest.raises(EnvError):
        make(data, small_games, max_steps=0)


def test_corrupt_game_files(data: Path, small_games: list[str], tmp_path: Path) -> None:
    """Garbage, a JSON file that is not a game, and games whose PDDL is broken."""
    source = data / small_games[0] / "game.tw-pddl"
    game = json.loads(source.read_text())
    problem = game["pddl_problem"]
    bad_goal = problem[: problem.index("(:goal")] + "(:goal (undeclaredPredicate agent1)))"
    broken = {
        "garbage": b"\x00\x9f garbage, not a game \xff",
        "notagame": json.dumps({"solvable": True, "walkthrough": []}).encode(),
        "badpddl": json.dumps({**game, "pddl_problem": "(define (problem p) (:init (("}).encode(),
        # fast-downward's translator answers this one with SystemExit
        "badgoal": json.dumps({**game, "pddl_problem": bad_goal}).encode(),
    }
    ids = {}
    for name, content in broken.items():
        trial = tmp_path / SPLITS[SPLIT] / f"pick_and_place_simple-{name}-None-Sofa-1" / "trial_T0"
        shutil.copytree(source.parent, trial)
        (trial / "game.tw-pddl").write_bytes(content)
        ids[name] = trial.relative_to(tmp_path).as_posix()
    good = tmp_path / small_games[0]
    shutil.copytree(source.parent, good)

    env = ALFWorldEnv(data_dir=tmp_path, split=SPLIT)
    assert set(env.game_ids) == {*ids.values(), small_games[0]}
    for game_id in ids.values():
        with pytest.raises(GameFileError) as exc:
            env.reset(options={"game": game_id})
        message = one_line(exc)
        assert game_id in message and "game.tw-pddl" in message, message
        assert "regenerate" in message or "not an ALFWorld game" in message, message
    # the env is still usable after a bad game
    obs, info = env.reset(options={"game": small_games[0]})
    assert obs.startswith("You are in the middle of a room") and info["game"] == small_games[0]


def test_discovery_sees_a_game_file_changed_in_the_same_process(
    generated_games: Path, tmp_path: Path
) -> None:
    """Discovery keeps what it read of each game while its files are unchanged (every env a
    worker builds discovers again): a file rewritten since is read again."""
    import os
    import shutil

    from envs.discovery import discover_games

    root = tmp_path / "data"
    shutil.copytree(generated_games, root)
    split = "eval_out_of_distribution"
    first = discover_games(root, split)
    assert discover_games(root, split) == first
    game = first[0].path
    text = game.read_text()
    assert '"solvable": true' in text
    game.write_text(text.replace('"solvable": true', '"solvable": false'))
    stat = game.stat()  # the same size: make sure the time moves even on a coarse clock
    os.utime(game, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert [g.game_id for g in discover_games(root, split)] == [g.game_id for g in first[1:]]
    traj = first[1].path.parent / "traj_data.json"
    traj.write_text('{"task_type": "look_at_obj_in_light"}')
    again = {g.game_id: g.task_type for g in discover_games(root, split)}
    assert again[first[1].game_id] == "look_at_obj_in_light"
