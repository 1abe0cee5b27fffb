"""TextWorldEnv and envs.twgen against the real TextWorld engine and its bundled Inform 7.

One session fixture compiles the two games of the TextWorld few-shot examples (a few seconds
each); every other test plays them or copies and damages their files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers reflexsim/TextWorld-v0)
from envs.errors import EnvError, GameFileError
from envs.spaces import CHARSET
from envs.textworld_env import (
    GAME_OVER,
    NOT_AVAILABLE,
    TextWorldEnv,
    clean_text,
    game_walkthrough,
    normalize_action,
    strip_banner,
)
from envs.twgen import challenge_settings, game_seeds, generate_textworld_games
from tests.support.walkthroughs import walkthrough_of

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES_FILE = ROOT / "agents" / "prompts" / "examples" / "textworld.json"
pytestmark = pytest.mark.filterwarnings("ignore::jericho.UnsupportedGameWarning")


def _load_recorder() -> Any:
    spec = importlib.util.spec_from_file_location(
        "record_textworld_examples", ROOT / "scripts" / "record_textworld_examples.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def recorder() -> Any:
    return _load_recorder()


@pytest.fixture(scope="session")
def game_root(tmp_path_factory: pytest.TempPathFactory, recorder: Any) -> Path:
    root = tmp_path_factory.mktemp("twgames")
    recorder.generate_example_games(root)
    return root


@pytest.fixture(scope="session")
def game_files(game_root: Path, recorder: Any) -> list[Path]:
    files = sorted(game_root.rglob("*.z8"))
    assert len(files) == len(recorder.EXAMPLES)
    return files


@pytest.fixture
def env(game_root: Path) -> Iterator[TextWorldEnv]:
    e = TextWorldEnv(game_dir=game_root)
    yield e
    e.close()


def _printable(text: str) -> bool:
    return all(c in CHARSET for c in text)


def _copy_game(src: Path, dst_dir: Path, stem: str = "game") -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst_dir / f"{stem}.z8")
    shutil.copy(src.with_suffix(".json"), dst_dir / f"{stem}.json")
    return dst_dir / f"{stem}.z8"


# -- the Gymnasium contract ----------------------------------------------------------------
def test_check_env_passes(game_root: Path) -> None:
    env = gym.make("reflexsim/TextWorld-v0", game_dir=str(game_root), max_steps=10)
    check_env(env.unwrapped)
    env.close()


def test_walkthrough_wins_every_game(env: TextWorldEnv) -> None:
    """The walkthrough the generator keeps, read through the ground-truth port, wins; no reset or
    step reply carries it."""
    assert len(env.game_ids) == 2
    for game_id in env.game_ids:
        obs, info = env.reset(options={"game": game_id})
        assert info["game"] == game_id and info["task_type"] == "textworld"
        walkthrough = walkthrough_of(info)
        assert info["score"] == 0 and not info["won"] and not info["lost"]
        total = 0.0
        replies = [info]
        for i, action in enumerate(walkthrough):
            assert action in info["admissible_commands"], action
            obs, reward, terminated, truncated, info = env.step(action)
            replies.append(info)
            total += reward
            assert _printable(obs) and not truncated
            assert terminated == (i == len(walkthrough) - 1)
        replies.append(env.step("look")[4])  # past the end
        for reply in replies:
            assert "walkthrough" not in reply and walkthrough not in reply.values()
        assert info["won"] and not info["lost"]
        assert info["score"] == info["max_score"] == total > 0
        assert "*** The End ***" in obs and "RESTART" not in obs


def test_reset_observation_drops_banner_keeps_objective_and_room(env: TextWorldEnv) -> None:
    for game_id in env.game_ids:
        obs, info = env.reset(options={"game": game_id})
        assert obs.startswith(info["task"]) and info["task"]
        assert "$$" not in obs and "\n\n\n" not in obs and obs == obs.strip()
        assert "-= " in obs  # the room's title
        assert _printable(obs)
        assert set(info) >= {
            "admissible_commands",
            "won",
            "lost",
            "score",
            "max_score",
            "task",
            "task_type",
            "game",
            "max_steps",
        }


def test_seed_picks_a_game_deterministically(game_root: Path) -> None:
    env = TextWorldEnv(game_dir=game_root)
    picks = [env.reset(seed=s)[1]["game"] for s in range(12)]
    assert picks == [env.reset(seed=s)[1]["game"] for s in range(12)]
    assert set(picks) == set(env.game_ids)
    env.close()


def test_step_limit_truncates(game_root: Path) -> None:
    env = TextWorldEnv(game_dir=game_root, max_steps=2)
    env.reset(seed=0)
    assert env.step("look")[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step("look")
    assert (terminated, truncated) == (False, True) and info["steps"] == 2
    env.close()


def test_losing_terminates_with_lost(env: TextWorldEnv) -> None:
    game_id = next(g for g in env.game_ids if g.startswith("tw-simple"))
    _, info = env.reset(options={"game": game_id})
    *before, last = walkthrough_of(info)  # ... take X, put X on stove
    for action in before:
        env.step(action)
    food = last.removeprefix("put ").removesuffix(" on stove")
    _, _, terminated, truncated, info = env.step(f"eat {food}")
    assert terminated and not truncated and info["lost"] and not info["won"]


def test_outcome_sticks_after_the_end(env: TextWorldEnv) -> None:
    _, info = env.reset(options={"game": env.game_ids[0]})
    for action in walkthrough_of(info):
        env.step(action)
    obs, reward, terminated, _, info = env.step("look")
    assert (obs, reward, terminated, info["won"]) == (GAME_OVER, 0.0, True, True)


def test_interpreter_commands_are_refused_and_game_stays_intact(env: TextWorldEnv) -> None:
    _, info = env.reset(options={"game": env.game_ids[1]})
    walkthrough = walkthrough_of(info)
    for action in ("restart", "QUIT", "save", "restore", "script", "tw-extra-infos score"):
        obs, reward, terminated, _, _ = env.step(action)
        assert (obs, reward, terminated) == (NOT_AVAILABLE, 0.0, False)
    # A backslash is a Frotz escape and a newline a second command: both are neutralised.
    obs, *_ = env.step("\\help")
    obs, *_ = env.step("look\n" + walkthrough[0])
    assert obs == "You can't see any such thing."  # one command: "look open ..."
    obs, *_ = env.step("look")
    assert obs.startswith("-= ")  # not the answer to a queued second command
    for action in walkthrough:
        *_, info = env.step(action)
    assert info["won"]


def test_one_engine_across_games(env: TextWorldEnv) -> None:
    first, second = env.game_ids
    env.reset(options={"game": first})
    engine = env._engine
    for game_id in (second, first, second):
        obs, info = env.reset(options={"game": game_id})
        assert env._engine is engine and info["game"] == game_id
    assert walkthrough_of(info)[0] in info["admissible_commands"]


def test_unknown_game_id(env: TextWorldEnv) -> None:
    with pytest.raises(EnvError, match="unknown game id"):
        env.reset(options={"game": "nope.z8"})


def test_single_game_file(game_files: list[Path]) -> None:
    env = TextWorldEnv(game_file=str(game_files[0]))
    assert env.game_ids == [game_files[0].name]
    obs, info = env.reset()
    assert info["game"] == game_files[0].name and obs
    env.close()


# -- bad input: one clear line, never a crash -----------------------------------------------
def _one_line_error(exc_info: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("name", "match"),
    [("missing.z8", "does not exist"), ("game.txt", "extension"), ("game.ulx", "Glulx")],
)
def test_bad_game_file_paths(tmp_path: Path, name: str, match: str) -> None:
    if name != "missing.z8":
        (tmp_path / name).write_bytes(b"x" * 100)
    with pytest.raises(GameFileError, match=match) as exc_info:
        TextWorldEnv(game_file=tmp_path / name)
    _one_line_error(exc_info)


def test_missing_json(tmp_path: Path, game_files: list[Path]) -> None:
    shutil.copy(game_files[0], tmp_path / "g.z8")
    with pytest.raises(GameFileError, match=r"no 'g\.json'"):
        TextWorldEnv(game_file=tmp_path / "g.z8")


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "garbage":
        data = bytearray(b"\xfe\xed" * 600)
    elif how == "truncated":
        data = data[: len(data) // 3]
    elif how == "flipped":
        data[len(data) // 2] ^= 0xFF
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("garbage", "not a Z-machine story file"),
        ("empty", "not a Z-machine story file"),
        ("truncated", "truncated"),
        ("flipped", "bad checksum"),
    ],
)
def test_corrupt_story_file_is_a_clear_error_and_env_recovers(
    tmp_path: Path, game_files: list[Path], how: str, match: str
) -> None:
    good = _copy_game(game_files[0], tmp_path, "good")
    bad = _copy_game(game_files[0], tmp_path, "bad")
    _damage(bad, how)
    env = TextWorldEnv(game_dir=tmp_path)
    env.reset(options={"game": "good.z8"})
    with pytest.raises(GameFileError, match=match) as exc_info:
        env.reset(options={"game": "bad.z8"})
    assert str(bad) in _one_line_error(exc_info)
    _, info = env.reset(options={"game": good.name})
    assert info["admissible_commands"]
    env.close()


def test_corrupt_json(tmp_path: Path, game_files: list[Path]) -> None:
    bad = _copy_game(game_files[0], tmp_path)
    bad.with_suffix(".json").write_text('{"version": ')
    env = TextWorldEnv(game_file=bad)
    with pytest.raises(GameFileError, match="could not be loaded") as exc_info:
        env.reset()
    _one_line_error(exc_info)


def test_story_and_json_of_different_games(tmp_path: Path, game_files: list[Path]) -> None:
    shutil.copy(game_files[0], tmp_path / "mixed.z8")
    shutil.copy(game_files[1].with_suffix(".json"), tmp_path / "mixed.json")
    env = TextWorldEnv(game_file=tmp_path / "mixed.z8")
    with pytest.raises(GameFileError, match="does not match"):
        env.reset()


def test_bad_constructor_arguments(tmp_path: Path, game_files: list[Path]) -> None:
    with pytest.raises(EnvError, match="exactly one"):
        TextWorldEnv()
    with pytest.raises(EnvError, match="exactly one"):
        TextWorldEnv(game_file=game_files[0], game_dir=tmp_path)
    with pytest.raises(EnvError, match="max_steps"):
        TextWorldEnv(game_file=game_files[0], max_steps=0)
    with pytest.raises(EnvError, match="does not exist"):
        TextWorldEnv(game_dir=tmp_path / "nowhere")
    (tmp_path / "old.ulx").write_bytes(b"Glul")
    with pytest.raises(EnvError, match="no .z8 games.*1 Glulx"):
        TextWorldEnv(game_dir=tmp_path)


# -- text helpers -----------------------------------------------------------------------------
def test_strip_banner_and_clean_text() -> None:
    raw = "\n\n\n   ____ \n  |$$  |\n \\$$$$/ \n\nDo the thing!\n\n-= Room =-\nA room.\n\n\n\n"
    assert clean_text(strip_banner(raw)) == "Do the thing!\n\n-= Room =-\nA room."
    end = "Done.\n\n\n      *** The End ***\n\nYou scored 1.\n\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"
    assert clean_text(end) == "Done.\n\n*** The End ***\n\nYou scored 1."
    assert normalize_action(" look\r\n at\\ me\t") == "look at me"
    assert len(normalize_action("x" * 5000)) < 198


# -- the generator ----------------------------------------------------------------------------
def test_same_seed_same_files(tmp_path: Path, game_root: Path, recorder: Any) -> None:
    spec = recorder.EXAMPLES[1]
    (again,) = generate_textworld_games(tmp_path, 1, spec.seed, spec.challenge, **spec.options)
    (first,) = (game_root / spec.folder).glob("*.z8")
    assert again.name == first.name
    assert again.read_bytes() == first.read_bytes()
    assert again.with_suffix(".json").read_bytes() == first.with_suffix(".json").read_bytes()
    assert not list(tmp_path.glob("*.ni"))
    assert game_walkthrough(again) == spec.walkthrough


def test_game_seeds_extend_and_differ() -> None:
    assert game_seeds(5, 3) == game_seeds(5, 8)[:3]
    assert len(set(game_seeds(5, 8))) == 8 and game_seeds(5, 3) != game_seeds(6, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"challenge": "tw-treasure"}, "unknown TextWorld challenge"),
        ({"challenge": "tw-simple", "recipe": 2}, "unknown option 'recipe'"),
        ({"challenge": "tw-simple", "goal": "vague"}, "goal='vague'"),
        ({"challenge": "tw-cooking", "go": 5}, "go=5"),
        ({"challenge": "tw-cooking", "recipe": 1, "take": 2}, "exceeds"),
        ({"challenge": "tw-cooking", "open": "yes"}, "True or False"),
    ],
)
def test_bad_generator_options(kwargs: dict[str, Any], match: str) -> None:
    challenge = kwargs.pop("challenge")
    with pytest.raises(EnvError, match=match):
        challenge_settings(challenge, **kwargs)


def test_bad_generator_counts(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match="n must be"):
        generate_textworld_games(tmp_path, 0, 1)
    with pytest.raises(EnvError, match="seed must be"):
        generate_textworld_games(tmp_path, 1, -1)


def test_generation_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFORM_HOME", str(tmp_path / "no-inform"))  # the compiler cannot be found
    with pytest.raises(EnvError, match="generation failed: game 0 .*no-inform") as exc_info:
        generate_textworld_games(tmp_path, 1, 0, "tw-cooking")
    _one_line_error(exc_info)


# -- the few-shot examples and the import rules -------------------------------------------------
def test_examples_file_is_what_the_recorder_plays(game_files: list[Path], recorder: Any) -> None:
    by_folder = {p.parent.name: p for p in game_files}
    files = [by_folder[s.folder] for s in recorder.EXAMPLES]
    assert recorder.render(recorder.record(files)) == EXAMPLES_FILE.read_text()
    examples = json.loads(EXAMPLES_FILE.read_text())["textworld"]
    assert len(examples) == 2
    for example in examples:
        assert set(example) == {"game", "observation", "steps"}
        thoughts = [s for s in example["steps"] if s["action"].startswith("think:")]
        assert thoughts and all(s["observation"] == "OK." for s in thoughts)


def test_importing_envs_does_not_import_textworld() -> None:
    code = (
        "import sys, envs, envs.textworld_env, envs.twgen; "
        "assert 'textworld' not in sys.modules and 'jericho' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
