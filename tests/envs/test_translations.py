"""Translations kept on disk (``envs.translations``): a game translated by one process is played by
another, with another hash seed, exactly as a freshly translated one (real engine, real games when
present, generated ones always); a bad entry or an unwritable directory never fails a game."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from envs import alfworld_env
from envs.alfworld_env import ALFWorldEnv
from envs.translations import DEFAULT_DIR, TranslationStore, cache_dir
from tests.conftest import alfworld_data_dir
from tests.envs.test_fast_text import (
    GENERATED_SPLIT,
    REAL_SPLIT,
    TranslationCount,
    small_games,
    trajectory,
)

ROOT = Path(__file__).resolve().parents[2]

# A child process: plays each game from the translation cache (or translates and stores it) and
# with no cache at all, each from its own first reset, and prints both trajectories (facts in
# the states' own iteration order included) and the translations it ran.
CHILD = r"""
import json, sys
args = json.loads(sys.argv[1])
import fast_downward
calls = []
real = fast_downward.pddl2sas
fast_downward.pddl2sas = lambda *a, **k: calls.append(1) or real(*a, **k)
from envs import alfworld_env
from envs.alfworld_env import ALFWorldEnv
from tests.envs.test_fast_text import trajectory
out = {"cached": [], "cold": [], "translations": 0}
for game in args["games"]:
    cached = ALFWorldEnv(args["data"], args["split"], games=[game], translation_cache=args["cache"])
    before = len(calls)
    out["cached"].append(trajectory(cached, game, 3))
    out["translations"] += (len(calls) - before) // 2
    out["cached"].append(trajectory(cached, game, 4))  # a reset from the process's own cache
    alfworld_env._LOADED.clear()
    cold = ALFWorldEnv(args["data"], args["split"], games=[game], reset_cache=0)
    out["cold"] += [trajectory(cold, game, 3), trajectory(cold, game, 4)]
print("RESULT " + json.dumps(out))
"""


def play_in_child(data: Path, split: str, games: list[str], cache: Path, seed: int) -> Any:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    args = json.dumps({"data": str(data), "split": split, "games": games, "cache": str(cache)})
    done = subprocess.run(
        [sys.executable, "-c", CHILD, args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("source", ["generated", "real"])
def test_a_stored_translation_plays_as_a_fresh_one_in_another_process(
    source: str, generated_games: Path, tmp_path: Path
) -> None:
    if source == "real":
        data = alfworld_data_dir()
        if data is None:
            pytest.skip("needs the real ALFWorld games ($ALFWORLD_DATA)")
        games, split = small_games(data, REAL_SPLIT, 3), REAL_SPLIT
    else:
        data, split = generated_games, GENERATED_SPLIT
        games = small_games(data, split, 3)
    cache = tmp_path / "translations"
    first = play_in_child(data, split, games, cache, seed=1)  # translates and stores
    assert first["translations"] == len(games)
    assert len(list(cache.rglob("*.json.z"))) == len(games)
    assert first["cached"] == first["cold"]  # everything, the facts' iteration order included
    second = play_in_child(data, split, games, cache, seed=2)  # another hash seed: reads them
    assert second["translations"] == 0
    # the same play and the same facts; the order a state iterates its facts in is the writer's
    # (a translation's own order changes with the hash seed: so does a fresh one's, below)
    assert [without_order(t) for t in second["cached"]] == [
        without_order(t) for t in second["cold"]
    ]
    assert [without_order(t) for t in second["cold"]] == [without_order(t) for t in first["cold"]]


def without_order(trajectory: list[Any]) -> list[Any]:
    """A trajectory (tests.envs.test_fast_text.trajectory) less its facts' iteration order."""
    return trajectory[:2] + trajectory[3:]


@pytest.fixture(autouse=True)
def no_games_loaded_before() -> Any:
    alfworld_env._LOADED.clear()
    yield
    alfworld_env._LOADED.clear()


def test_an_unreadable_entry_is_translated_again_and_rewritten(
    generated_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    game = small_games(generated_games, GENERATED_SPLIT, 1)[0]
    count = TranslationCount(monkeypatch)
    cache = tmp_path / "translations"

    def play() -> Any:
        alfworld_env._LOADED.clear()
        env = ALFWorldEnv(generated_games, GENERATED_SPLIT, games=[game], translation_cache=cache)
        return trajectory(env, game, 5)

    want = play()
    (entry,) = cache.rglob("*.json.z")
    assert count.during(play) == 0
    good = entry.read_bytes()
    entry.write_bytes(good[: len(good) // 2])  # a write cut short (by hand: ours are atomic)
    with caplog.at_level(logging.WARNING, logger="envs.translations"):
        assert count.during(lambda: assert_equal(play(), want)) == 1
    assert "unreadable" in caplog.text and str(entry) in caplog.text
    assert entry.read_bytes() == good  # written again whole
    assert count.during(play) == 0


def test_an_entry_that_cannot_be_used_is_translated_instead(
    generated_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """An entry under the right name whose content is not a translation's (edited by hand, or
    written by a bug) is logged and the game translated: the cache never fails a game."""
    from envs.alfworld_env import load_game_data

    game = small_games(generated_games, GENERATED_SPLIT, 1)[0]
    data = load_game_data(generated_games / game / "game.tw-pddl")
    store = TranslationStore(tmp_path)
    store.put(data["pddl_domain"], data["pddl_problem"], {"pddl_problem": data["pddl_problem"]})
    count = TranslationCount(monkeypatch)
    env = ALFWorldEnv(generated_games, GENERATED_SPLIT, games=[game], translation_cache=tmp_path)
    cold = ALFWorldEnv(generated_games, GENERATED_SPLIT, games=[game], reset_cache=0)
    with caplog.at_level(logging.WARNING, logger="envs.alfworld_env"):
        got = count.during(
            lambda: assert_equal(trajectory(env, game, 2), trajectory(cold, game, 2))
        )
    assert got == 2  # the env's, then the cold env's
    assert "could not be used" in caplog.text


def assert_equal(got: Any, want: Any) -> None:
    assert got == want


def test_a_cache_that_cannot_be_written_warns_once_and_plays(
    generated_games: Path, tmp_path: Path, caplog: Any
) -> None:
    games = small_games(generated_games, GENERATED_SPLIT, 2)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    env = ALFWorldEnv(generated_games, GENERATED_SPLIT, translation_cache=blocked)
    cold = ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=0)
    with caplog.at_level(logging.WARNING, logger="envs.translations"):
        for game in games:
            assert trajectory(env, game, 1) == trajectory(cold, game, 1)
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and str(blocked) in warnings[0].getMessage()


def test_an_entry_is_named_by_the_problem_and_the_libraries(tmp_path: Path) -> None:
    store = TranslationStore(tmp_path)
    assert store.key("d", "p") != store.key("d", "q") != store.key("e", "q")
    assert store.key("d", "p") == TranslationStore(tmp_path / "x").key("d", "p")
    store.put("d", "p", {"pddl_problem": "p", "sas": "s"})
    assert store.get("d", "p") == {"pddl_problem": "p", "sas": "s"}
    assert store.get("d", "q") is None
    # an entry found under another problem's name (a hash collision, a file copied by hand)
    path = next(tmp_path.rglob("*.json.z"))
    target = store._path(store.key("d", "q"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())
    assert store.get("d", "q") is None


def test_translation_cache_setting_reaches_every_env_worker(generated_games: Path) -> None:
    """``--translation-cache``: the default directory, one of the user's, or off."""
    from envs.pool import EnvSpec
    from experiments.config import RunConfig
    from experiments.games import select_games

    assert cache_dir(None) == str(DEFAULT_DIR)
    for given, used in (
        ({}, DEFAULT_DIR),
        ({"translation_cache": "/some/where"}, Path("/some/where")),
        ({"translation_cache": "off"}, None),
    ):
        cfg = RunConfig.of(data=str(generated_games), split=GENERATED_SPLIT, **given)
        games = select_games(cfg)
        env = EnvSpec(games.env_kind, games.env_kwargs).build()
        try:
            root = env.translations.root if env.translations is not None else None
            assert root == used
        finally:
            env.close()
