"""The fast text path and the reset cache play exactly TextWorld's games (real engine and games).

Random walks compare the default env (fast text, reset cache) with the reference env
(``fast_text=False, reset_cache=0``: TextWorld's own grammar, a translation every reset), one env
per path stepping the same walk in lockstep, in two worker processes. The reference is the cost
(~70 ms a step against ~2), so for the long walk (6,000 steps over 14 games; 10,000 over 22 with
REFLEXSIM_FULL_CHECKS=1) it runs TextWorld's derivation code with two pure parts made cheap: its
TatSu parsers memoized (a parse is a function of its string; every memoized parse is checked
against a fresh one at the end) and contexts copied shallowly (nothing mutates their entities or
placeholders). That leaves ~20 ms a step. A 600-step walk compares with TextWorld left entirely
alone.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import random
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from envs import alfworld_env
from envs.alfworld_env import ALFWorldEnv
from envs.discovery import SPLITS
from tests.conftest import FULL_CHECKS, alfworld_data_dir

REAL_SPLIT = "eval_in_distribution"
GENERATED_SPLIT = "eval_out_of_distribution"  # the conftest's generated games
EPISODE = 250  # steps before a walk resets (a win resets sooner)
# The long walk: its real games and its steps in all. A walk's fixed cost, its loads and the
# reference's translation at every reset, outweighs its steps: CI walks fewer games, each still
# long enough to reset its game at least twice (a reset from the cache, then compared).
LONG_WALK_REAL_GAMES, LONG_WALK = (16, 10_000) if FULL_CHECKS else (6, 4_000)


@dataclass(frozen=True)
class Walk:
    data_dir: Path
    split: str
    game: str
    steps: int
    seed: int
    memoize_parser: bool


@dataclass(frozen=True)
class Outcome:
    game: str
    compared: int  # steps found identical (every reset before them was too)
    mismatch: str | None
    fallbacks: int  # derivations the fast env left to TextWorld's grammar
    parses_checked: int


def _memoize_textworld_parser() -> dict[tuple[str, str], Any]:
    """In this (worker) process: memoize TextWorld's grammar and query parsers, and copy
    derivation contexts shallowly (their values, entities and placeholders, are never mutated:
    the unmodified-TextWorld walk checks that too)."""
    from textworld.envs.pddl import textgen
    from textworld.logic import Rule

    parse, query = textgen._parse_and_convert, Rule.parse_conjunctive_query.__func__
    memo: dict[tuple[str, str], Any] = {}

    def memo_parse(text: str, rule_name: str, **kwargs: Any) -> Any:
        if (text, rule_name) not in memo:
            memo[text, rule_name] = parse(text, rule_name=rule_name, **kwargs)
        return copy.deepcopy(memo[text, rule_name])  # derive() mutates the symbols it gets

    def memo_query(cls: type, text: str) -> Any:
        if (text, "query") not in memo:
            memo[text, "query"] = query(cls, text)
        return memo[text, "query"]

    def copy_context(context: dict[str, Any]) -> dict[str, Any]:
        copied = dict(context)
        copied["variables"], copied["mapping"] = (
            dict(context["variables"]),
            dict(context["mapping"]),
        )
        return copied

    textgen._parse_and_convert = memo_parse
    textgen.copy_context = copy_context
    Rule.parse_conjunctive_query = classmethod(memo_query)  # type: ignore[method-assign,assignment]
    memo["__originals__", ""] = (parse, query)
    return memo


def _check_memo(memo: dict[tuple[str, str], Any]) -> int:
    from textworld.logic import Rule

    parse, query = memo.pop(("__originals__", ""))
    for (text, rule_name), parsed in memo.items():
        fresh = query(Rule, text) if rule_name == "query" else parse(text, rule_name=rule_name)
        assert repr(fresh) == repr(parsed), text
    return len(memo)


def walk_side_by_side(walk: Walk) -> Outcome:
    """Play a seeded random walk through both envs; stop at the first difference."""
    memo = _memoize_textworld_parser() if walk.memoize_parser else None
    kwargs: dict[str, Any] = {"data_dir": walk.data_dir, "split": walk.split, "max_steps": 10**6}
    fast = ALFWorldEnv(games=[walk.game], **kwargs)
    ref = ALFWorldEnv(games=[walk.game], fast_text=False, reset_cache=0, **kwargs)
    rng = random.Random(walk.seed)
    compared = 0
    while compared < walk.steps:
        got: Any = fast.reset(options={"game": walk.game})
        want: Any = ref.reset(options={"game": walk.game})
        if got != want:
            return Outcome(walk.game, compared, f"reset: {got[0]!r} != {want[0]!r}", 0, 0)
        for _ in range(min(EPISODE, walk.steps - compared)):
            commands = got[-1]["admissible_commands"]
            action = rng.choice(commands) if rng.random() > 0.05 else "jump around"
            got, want = fast.step(action), ref.step(action)
            compared += 1
            if got != want:
                diff = f"step {compared} {action!r}: {got[0]!r} != {want[0]!r}"
                return Outcome(walk.game, compared, diff, 0, 0)
            if got[2]:
                break
    checked = _check_memo(memo) if memo is not None else 0
    return Outcome(walk.game, compared, None, fast.text_stats()["fallbacks"], checked)


def play(walks: list[Walk]) -> list[Outcome]:
    """The walks in two worker processes (the reference env is the slow part)."""
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(walk_side_by_side, walks))


def evenly(items: list[str], n: int) -> list[str]:
    return items[:: max(1, len(items) // n)][:n]


def walks_over(
    generated: Path, n_generated: int, n_real: int, total: int, memoize: bool
) -> list[Walk]:
    """Walks of ``total`` steps in all over generated games and (when present) real games."""
    ids = evenly(ALFWorldEnv(generated, GENERATED_SPLIT).game_ids, n_generated)
    games = [(generated, GENERATED_SPLIT, g) for g in ids]
    real = alfworld_data_dir()
    if real is not None:
        ids = evenly(ALFWorldEnv(real, REAL_SPLIT).game_ids, n_real)
        games += [(real, REAL_SPLIT, g) for g in ids]
    steps = -(-total // len(games))
    return [Walk(d, s, g, steps, seed, memoize) for seed, (d, s, g) in enumerate(games)]


def assert_identical(outcomes: list[Outcome], total: int) -> None:
    mismatches = [f"{o.game}: {o.mismatch}" for o in outcomes if o.mismatch]
    assert not mismatches, "\n".join(mismatches)
    assert sum(o.compared for o in outcomes) >= total
    # ALFWorld's grammars need nothing from TextWorld's grammar: the fast path made every text
    assert [o.fallbacks for o in outcomes] == [0] * len(outcomes)


# -- 1. random walks: every observation, admissible list, reward and `won` identical -------------
@pytest.mark.slow
def test_random_walks_match_textworld(generated_games: Path) -> None:
    """LONG_WALK steps over LONG_WALK_REAL_GAMES valid_seen games (when present) and 6 generated
    games."""
    walks = walks_over(generated_games, 6, LONG_WALK_REAL_GAMES, total=LONG_WALK, memoize=True)
    outcomes = play(walks)
    assert_identical(outcomes, LONG_WALK)
    assert all(o.parses_checked > 0 for o in outcomes)


@pytest.mark.slow
def test_random_walks_match_unmodified_textworld(generated_games: Path) -> None:
    """600 steps against TextWorld left entirely alone (~70 ms a step)."""
    outcomes = play(walks_over(generated_games, 4, 2, total=600, memoize=False))
    assert_identical(outcomes, 600)


# -- 2. the reset cache: same state, same trajectory, bounded --------------------------------------
def small_games(root: Path, split: str, n: int) -> list[str]:
    files = sorted((root / SPLITS[split]).glob("*/*/game.tw-pddl"), key=lambda f: f.stat().st_size)
    return [f.parent.relative_to(root).as_posix() for f in files[:n]]


def trajectory(env: ALFWorldEnv, game: str, seed: int, steps: int = 12) -> list[Any]:
    """The reset and a seeded random walk, with the engine's own state after the reset."""
    got: Any = env.reset(options={"game": game})
    state = env._engine._pddl_state
    out = [got, sorted(map(str, state.facts)), list(map(str, state.facts)), state.name2type]
    rng = random.Random(seed)
    for _ in range(steps):
        got = env.step(rng.choice(got[-1]["admissible_commands"]))
        out.append(got)
    return out


@pytest.mark.parametrize("fast_text", [True, False])
def test_cached_reset_equals_a_cold_one(generated_games: Path, fast_text: bool) -> None:
    games = small_games(generated_games, GENERATED_SPLIT, 2)
    cached = ALFWorldEnv(generated_games, GENERATED_SPLIT, fast_text=fast_text, reset_cache=4)
    cold = ALFWorldEnv(generated_games, GENERATED_SPLIT, fast_text=fast_text, reset_cache=0)
    # first episode, a replay of the same game, another game, then back (a cache hit on load)
    for seed, game in enumerate([games[0], games[0], games[1], games[0], games[0]]):
        assert trajectory(cached, game, seed) == trajectory(cold, game, seed), (seed, game)


def test_restored_state_is_built_as_a_translated_one(generated_games: Path) -> None:
    """Same attributes, same data structures (equal, in the same order) as a translation."""
    game = small_games(generated_games, GENERATED_SPLIT, 1)[0]
    cached = ALFWorldEnv(generated_games, GENERATED_SPLIT, games=[game])
    cold = ALFWorldEnv(generated_games, GENERATED_SPLIT, games=[game], reset_cache=0)
    cached.reset(options={"game": game})
    cached.step("look")
    cached.reset(options={"game": game})
    cold.reset(options={"game": game})
    restored, translated = cached._engine._pddl_state, cold._engine._pddl_state
    assert set(vars(restored)) == set(vars(translated))
    for name in ("_facts", "_vars_by_name", "_vars_by_type", "_var_counts", "name2type", "sas"):
        mine, theirs = getattr(restored, name), getattr(translated, name)
        assert mine == theirs and list(mine) == list(theirs), name
    for sig, facts in translated._facts.items():
        assert list(restored._facts[sig]) == list(facts), sig


@pytest.fixture(autouse=True)
def no_games_loaded_before() -> Any:
    """Each test starts with the process's cache of loaded games empty (its counts depend on it)."""
    alfworld_env._LOADED.clear()
    yield
    alfworld_env._LOADED.clear()


class TranslationCount:
    """Counts fast-downward translations (the real translator runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import fast_downward

        self.calls = 0
        real = fast_downward.pddl2sas

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(fast_downward, "pddl2sas", counted)

    def during(self, fn: Any) -> int:
        before = self.calls
        fn()
        return (self.calls - before) // 2  # PddlState translates twice (play, replanning)


def test_reset_cache_translates_each_game_once_and_stays_bounded(
    generated_games: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = small_games(generated_games, GENERATED_SPLIT, 3)
    count = TranslationCount(monkeypatch)
    env = ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=2)

    def reset(game: str) -> Any:
        return lambda: env.reset(options={"game": game})

    assert count.during(reset(a)) == 1
    assert count.during(reset(a)) == 0  # a replay of the same game
    assert count.during(reset(b)) == 1
    assert count.during(reset(a)) == 0  # back to a: reloaded from the cache
    assert count.during(reset(c)) == 1  # evicts b, the least recently loaded
    assert count.during(reset(b)) == 1
    assert count.during(reset(a)) == 1  # evicted by b
    off = ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=0)
    assert count.during(lambda: off.reset(options={"game": a})) == 1
    assert count.during(lambda: off.reset(options={"game": a})) == 1


def test_the_engines_of_a_process_share_its_games_and_play_apart(
    generated_games: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env worker keeps an engine per slot: a game one engine translated is restored by
    another without translating, into that engine's own fast-downward; the two then play on,
    interleaved, each exactly as a cold env does."""
    game = small_games(generated_games, GENERATED_SPLIT, 1)[0]
    count = TranslationCount(monkeypatch)
    envs = [ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=4) for _ in range(2)]
    colds = [ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=0) for _ in range(2)]
    got: list[Any] = [None, None]
    assert count.during(lambda: got.__setitem__(0, envs[0].reset(options={"game": game}))) == 1
    assert count.during(lambda: got.__setitem__(1, envs[1].reset(options={"game": game}))) == 0
    assert envs[0]._engine._pddl_state.downward_lib is not envs[1]._engine._pddl_state.downward_lib
    want: list[Any] = [cold.reset(options={"game": game}) for cold in colds]
    assert got == want
    rngs = [random.Random(1), random.Random(2)]
    for _ in range(12):
        for i in (0, 1):  # one step each, in turn
            action = rngs[i].choice(want[i][-1]["admissible_commands"])
            got[i], want[i] = envs[i].step(action), colds[i].step(action)
            assert got[i] == want[i], (i, action)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_reset_cache_is_one_clear_line(generated_games: Path, bad: Any) -> None:
    from envs.errors import EnvError

    with pytest.raises(EnvError) as exc:
        ALFWorldEnv(generated_games, GENERATED_SPLIT, reset_cache=bad)
    message = str(exc.value)
    assert "\n" not in message and "reset_cache" in message and ">= 0" in message


# -- 3. what the fast path cannot do itself, TextWorld's grammar does -------------------------------
def test_an_unusual_expression_is_left_to_textworld(generated_games: Path, tmp_path: Path) -> None:
    """A grammar expression outside the side-effect-free subset: same text, by TextWorld."""
    game = small_games(generated_games, GENERATED_SPLIT, 1)[0]
    target = tmp_path / game
    shutil.copytree(generated_games / game, target)
    data = json.loads((target / "game.tw-pddl").read_text())
    old = "You arrive at {r.name}."
    assert old in data["grammar"]
    data["grammar"] = data["grammar"].replace(old, "You arrive at {r.name.upper()}.")
    (target / "game.tw-pddl").write_text(json.dumps(data))

    fast = ALFWorldEnv(tmp_path, GENERATED_SPLIT)
    ref = ALFWorldEnv(tmp_path, GENERATED_SPLIT, fast_text=False)
    got, want = fast.reset(options={"game": game}), ref.reset(options={"game": game})
    assert got == want
    go = next(c for c in got[1]["admissible_commands"] if c.startswith("go to "))
    got, want = fast.step(go), ref.step(go)
    assert got == want and got[0].startswith("You arrive at " + go[len("go to ") :].upper())
    stats = fast.text_stats()
    assert stats["fallbacks"] >= 1 and stats["misses"] > 0
    assert ref.text_stats() == {}
