"""The env worker pool: real worker processes, the real ALFWorld engine, real SIGKILLs."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.alfworld_env import ALFWorldEnv
from envs.discovery import SPLITS
from envs.errors import EnvError
from envs.pool import EnvPool, EnvSpec, Reset, SyncEnvPool, WorkerCrashed
from memory.records import EnvReply
from tests.conftest import require_alfworld_data
from tests.support.processes import wait_dead

SPLIT = "eval_in_distribution"
HEAVY = ("textworld", "alfworld", "fast_downward", "torch")


class SleepyEnv:
    """A test-only env kind: "sleep S" sleeps S seconds, "wait PATH" until PATH exists (also as a
    game, whose reset waits), "exit"
    kills the process, "heavy" names the heavy modules the worker has imported, "fail" raises;
    anything else is echoed."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self.steps = 0
        game = (options or {}).get("game", f"seed-{seed}")
        if game.startswith("wait "):  # a slow game load: until the file exists
            while not os.path.exists(game[5:]):
                time.sleep(0.01)
        return "awake", {"game": game, "pid": os.getpid()}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if action.startswith("sleep "):
            time.sleep(float(action.split()[1]))
        elif action.startswith("wait "):  # until the file exists
            while not os.path.exists(action[5:]):
                time.sleep(0.01)
        elif action == "exit":
            os._exit(3)
        elif action == "heavy":
            return " ".join(m for m in HEAVY if m in sys.modules), 0.0, False, False, {}
        elif action == "fail":
            raise RuntimeError("the env broke")
        return f"did {action}", 0.0, False, False, {"steps": self.steps, "pid": os.getpid()}

    def close(self) -> None:
        pass


SLEEPY = EnvSpec(f"{SleepyEnv.__module__}:SleepyEnv")


data_root = require_alfworld_data  # the real games, or the test is skipped


@pytest.fixture(scope="module")
def games() -> dict[str, list[str]]:
    """Two small games with walkthroughs of different lengths (>= 4), and their walkthroughs."""
    root = data_root()
    files = sorted((root / SPLITS[SPLIT]).glob("*/*/game.tw-pddl"), key=lambda f: f.stat().st_size)
    picked: dict[str, list[str]] = {}
    for f in files:
        game = json.loads(f.read_text())
        walkthrough = list(game.get("walkthrough") or ())
        if game.get("solvable") and len(walkthrough) >= 4:
            if all(len(w) != len(walkthrough) for w in picked.values()):
                picked[f.parent.relative_to(root).as_posix()] = walkthrough
        if len(picked) == 2:
            return picked
    pytest.skip("need two small games with walkthroughs")


@pytest.fixture(scope="module")
def spec(games: dict[str, list[str]]) -> EnvSpec:
    return EnvSpec("alfworld", {"data_dir": data_root(), "split": SPLIT, "games": list(games)})


Trace = list[tuple[str, tuple[str, ...], float, bool]]


def trace(result: EnvReply) -> tuple[str, tuple[str, ...], float, bool]:
    return (
        result.observation,
        tuple(result.info["admissible_commands"]),
        result.reward,
        result.terminated,
    )


@pytest.fixture(scope="module")
def reference(spec: EnvSpec, games: dict[str, list[str]]) -> dict[str, Trace]:
    """Each game played alone, one env, one after the other (with two probing actions first)."""
    out: dict[str, Trace] = {}
    env = ALFWorldEnv(**spec.kwargs)
    for game, walkthrough in games.items():
        obs, info = env.reset(options={"game": game})
        steps = [(obs, tuple(info["admissible_commands"]), 0.0, False)]
        for action in ["look", "dance", *walkthrough]:
            obs, reward, terminated, _, info = env.step(action)
            steps.append((obs, tuple(info["admissible_commands"]), reward, terminated))
        out[game] = steps
    return out


@pytest.fixture(scope="module")
def pool(spec: EnvSpec) -> Iterator[EnvPool]:
    with EnvPool(spec, workers=2, timeout_s=120) as p:
        yield p


def script(games: dict[str, list[str]], game: str) -> list[str]:
    return ["look", "dance", *games[game]]


# -- the real engine -----------------------------------------------------------------------------
def test_two_workers_match_one_env_played_sequentially(
    pool: EnvPool, games: dict[str, list[str]], reference: dict[str, Trace]
) -> None:
    names = list(games)
    started = pool.reset_many({slot: Reset(game) for slot, game in enumerate(names)})
    got: dict[str, Trace] = {}
    for slot, game in enumerate(names):
        result = started[slot]
        assert isinstance(result, EnvReply)
        got[game] = [trace(result)]
    assert pool.pid(0) != pool.pid(1)
    # step both slots together; the shorter episode finishes first and drops out
    for i in range(max(len(script(games, g)) for g in names)):
        actions = {s: script(games, g)[i] for s, g in enumerate(names) if i < len(script(games, g))}
        for slot, result in pool.step_many(actions).items():
            assert isinstance(result, EnvReply), result
            got[names[slot]].append(trace(result))
    assert got == reference
    assert all(steps[-1][2:] == (1.0, True) for steps in got.values())
    assert pool.actions(0) == tuple(script(games, names[0]))


def test_replay_reproduces_the_exact_state(
    pool: EnvPool, games: dict[str, list[str]], reference: dict[str, Trace]
) -> None:
    game = list(games)[1]
    actions = script(games, game)
    for n in (2, len(actions) - 1):
        result = pool.reset(0, game, replay=actions[:n])
        assert trace(result) == reference[game][n]
        assert pool.actions(0) == tuple(actions[:n])
    last = pool.step(0, actions[-1])
    assert trace(last) == reference[game][-1] and last.info["won"]


def test_killed_worker_is_replaced_and_the_other_slot_carries_on(
    pool: EnvPool, games: dict[str, list[str]], reference: dict[str, Trace]
) -> None:
    names = list(games)
    pool.reset_many({0: Reset(names[0]), 1: Reset(names[1])})
    first = pool.step_many({0: "look", 1: "look"})
    assert all(isinstance(r, EnvReply) for r in first.values())
    victim = pool.pid(1)
    assert victim is not None
    restarts = pool.restarts
    os.kill(victim, signal.SIGKILL)
    results = pool.step_many({0: "dance", 1: "dance"})

    crash = results[1]
    assert isinstance(crash, WorkerCrashed)
    assert (crash.slot, crash.actions, crash.pending) == (1, ("look",), "dance")
    assert crash.game == names[1]
    assert "signal 9" in str(crash) and "replay" in str(crash)
    assert isinstance(results[0], EnvReply)
    assert trace(results[0]) == reference[names[0]][2]
    assert pool.restarts == restarts + 1 and pool.pid(1) not in (None, victim)

    # the other slot carries on to its win
    for i, action in enumerate(games[names[0]]):
        assert trace(pool.step(0, action)) == reference[names[0]][3 + i]
    # the interrupted episode is re-simulated on the fresh worker and continues
    resumed = pool.reset(1, crash.game, replay=crash.actions)
    assert trace(resumed) == reference[names[1]][1]
    assert crash.pending is not None
    assert trace(pool.step(1, crash.pending)) == reference[names[1]][2]


def test_pool_errors_come_back_as_the_envs_own(pool: EnvPool) -> None:
    with pytest.raises(EnvError, match="unknown game id"):
        pool.reset(0, "json_2.1.1/valid_seen/no-such-game/trial_T0")
    with pytest.raises(EnvError, match="no episode"):  # the failed reset left none
        pool.step(0, "look")
    with pytest.raises(EnvError, match="out of range"):
        pool.step(5, "look")


def test_sync_pool_gives_the_same_answers(
    spec: EnvSpec, games: dict[str, list[str]], reference: dict[str, Trace]
) -> None:
    game = list(games)[0]
    actions = script(games, game)
    with SyncEnvPool(spec) as sync:
        assert trace(sync.reset(0, game, replay=actions[:3])) == reference[game][3]
        results = sync.step_many({0: actions[3]})
        assert trace(results[0]) == reference[game][4]  # type: ignore[arg-type]
        assert sync.actions(0) == tuple(actions[:4])


# -- crashes and hangs (a cheap env) -------------------------------------------------------------
def test_hung_worker_times_out_and_is_replaced() -> None:
    with EnvPool(SLEEPY, workers=2, timeout_s=5) as pool:
        pool.reset_many({0: Reset("a"), 1: Reset("b")})
        assert pool.step(0, "heavy").observation == ""  # nothing heavy imported in a worker
        pool.step(0, "wave")
        hung = pool.pid(0)
        results = pool.step_many({0: "sleep 60", 1: "wave"})
        crash = results[0]
        assert isinstance(crash, WorkerCrashed) and "timed out" in crash.reason
        assert (crash.actions, crash.pending, crash.game) == (("heavy", "wave"), "sleep 60", "a")
        assert isinstance(results[1], EnvReply) and results[1].observation == "did wave"
        assert pool.pid(0) != hung
        assert hung is not None and not _alive(hung)
        # the slot is lost until it is reset; then the fresh worker serves it
        with pytest.raises(WorkerCrashed):
            pool.step(0, "wave")
        fresh = pool.reset(0, "a", replay=crash.actions)
        assert fresh.info == {"steps": 2, "pid": pool.pid(0)}
        assert pool.step(1, "wave").info["steps"] == 2


def test_worker_exit_and_env_errors() -> None:
    with EnvPool(SLEEPY, workers=1, timeout_s=30) as pool:
        pool.reset(0, "a")
        with pytest.raises(RuntimeError, match="the env broke") as exc:
            pool.step(0, "fail")  # the env's error; the worker lives on
        assert "in the env worker" in "".join(getattr(exc.value, "__notes__", ()))
        assert pool.step(0, "wave").info["steps"] == 2
        with pytest.raises(WorkerCrashed, match="exit code 3"):
            pool.step(0, "exit")
        # a worker killed while idle is noticed on the next call
        pool.reset(0, "a")
        victim = pool.pid(0) or 0
        os.kill(victim, signal.SIGKILL)
        wait_dead(victim)
        with pytest.raises(WorkerCrashed, match="signal 9"):
            pool.step(0, "wave")
        assert pool.reset(0, "a").observation == "awake"
        assert pool.restarts == 2


def test_more_slots_than_workers() -> None:
    """Slots share a worker in turn; a hang takes every episode on that worker with it."""
    with EnvPool(SLEEPY, workers=2, slots=4, timeout_s=5) as pool:
        started = pool.reset_many({s: Reset(f"g{s}") for s in range(4)})
        assert {r.info["pid"] for r in started.values()} == {pool.pid(0), pool.pid(1)}  # type: ignore[union-attr]
        results = pool.step_many({0: "wave", 2: "sleep 60", 1: "wave", 3: "wave"})
        assert isinstance(results[0], EnvReply)  # answered before the hang
        assert isinstance(results[2], WorkerCrashed) and results[2].pending == "sleep 60"
        assert all(isinstance(results[s], EnvReply) for s in (1, 3))  # the other worker
        # slot 0's env died with its worker: its next call says so
        lost = pool.step_many({0: "wave", 1: "wave"})
        assert isinstance(lost[0], WorkerCrashed) and lost[0].actions == ("wave",)
        assert isinstance(lost[1], EnvReply) and lost[1].info["steps"] == 2


def test_a_new_episode_goes_to_the_worker_with_less_work(tmp_path: Path) -> None:
    """A reset that starts another game goes to the least busy worker (the slot moves with
    it); a restore of the slot's own game stays where its reset cache is."""
    gate = tmp_path / "gate"
    with EnvPool(SLEEPY, workers=2, slots=4, timeout_s=60) as pool:
        pool.reset_many({s: Reset(f"g{s}") for s in range(4)})
        assert [pool.worker_of(s) for s in range(4)] == [0, 1, 0, 1]
        pool.submit({0: f"wait {gate}"})  # worker 0 is busy
        pool.submit({2: Reset("g9")})  # slot 2's next game: worker 1 is free
        got = pool.collect()
        assert set(got) == {2} and got[2].info["pid"] == pool.pid(1)  # type: ignore[union-attr]
        assert pool.worker_of(2) == 1
        assert pool.step(2, "wave").info["pid"] == pool.pid(1)  # its steps follow it
        pool.submit({3: "sleep 0.5"})  # worker 1 busy too: a restore still stays on it
        pool.submit({2: Reset("g9", None, ("wave",))})
        gate.touch()
        answers: dict[int, Any] = {}
        while len(answers) < 3:
            answers.update(pool.collect())
        assert answers[2].info["pid"] == pool.pid(1) and answers[2].info["steps"] == 1
        assert pool.worker_of(0) == 0 and pool.restarts == 0


def test_a_game_goes_back_to_the_worker_that_loaded_it() -> None:
    """A game's next reset (its next trial, on another slot) goes to the worker whose reset
    cache holds it, when that worker is no busier."""
    with EnvPool(SLEEPY, workers=2, slots=4, timeout_s=60) as pool:
        pool.reset_many({0: Reset("a"), 1: Reset("b")})
        assert [pool.worker_of(s) for s in (0, 1)] == [0, 1]
        moved = pool.reset_many({1: Reset("a")})  # slot 1's next game: worker 0 loaded it
        assert pool.worker_of(1) == 0 and moved[1].info["pid"] == pool.pid(0)  # type: ignore[union-attr]


def test_a_step_waits_for_one_reset_not_for_every_reset_queued(tmp_path: Path) -> None:
    """A worker gets its queued steps and at most one reset at a time: a step that comes while
    it loads a game is answered before the next game's load begins."""
    first, second = tmp_path / "first", tmp_path / "second"
    with EnvPool(SLEEPY, workers=1, slots=3, timeout_s=60) as pool:
        pool.reset_many({s: Reset(f"g{s}") for s in range(3)})
        pool.submit({1: Reset(f"wait {first}"), 2: Reset(f"wait {second}")})
        pool.submit({0: "wave"})  # queued while the worker loads the first game
        first.touch()
        answers: dict[int, Any] = {}
        while not {0, 1} <= answers.keys():
            got = pool.collect(timeout=30)
            assert got, "no answer in 30 s"
            answers.update(got)
        assert 2 not in answers  # the second load is still waiting for its file
        assert answers[0].observation == "did wave"  # type: ignore[union-attr]
        second.touch()
        assert set(pool.collect(timeout=30)) == {2}


def test_submit_and_collect_hand_back_each_answer_when_it_arrives(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with EnvPool(SLEEPY, workers=2, timeout_s=60) as pool:
        pool.reset_many({0: Reset("a"), 1: Reset("b")})
        pool.submit({0: f"wait {gate}", 1: "wave"})
        assert pool.in_flight == {0, 1}
        first = pool.collect()
        assert set(first) == {1}  # slot 0 cannot answer before the gate opens
        with pytest.raises(EnvError, match="in flight"):
            pool.submit({0: "wave"})
        # slot 1 goes on while slot 0 is busy, through the blocking call too
        assert pool.step(1, "wave").info["steps"] == 2
        assert pool.collect(timeout=0.05) == {}
        gate.touch()
        second = pool.collect(timeout=60)
        assert set(second) == {0} and second[0].observation == f"did wait {gate}"  # type: ignore[union-attr]
        assert pool.in_flight == frozenset() and pool.collect() == {}
    with SyncEnvPool(SLEEPY, slots=2) as sync:
        sync.reset(0, "a")
        sync.submit({0: "wave", 1: "wave"})
        assert sync.in_flight == {0, 1}
        answers = sync.collect()
        assert isinstance(answers[0], EnvReply) and isinstance(answers[1], EnvError)


def test_bad_pool_arguments() -> None:
    with pytest.raises(EnvError, match="unknown env kind"):
        EnvPool(EnvSpec("chess"), workers=1)
    with pytest.raises(EnvError, match="cannot import"):
        SyncEnvPool(EnvSpec("no_such_module:Env"))
    with pytest.raises(EnvError, match="workers"):
        EnvPool(SLEEPY, workers=0)
    with pytest.raises(EnvError, match="start_method"):
        EnvPool(SLEEPY, workers=1, start_method="fork")  # type: ignore[arg-type]
    with pytest.raises(EnvError, match="replay"):
        Reset("a", replay="look")  # type: ignore[arg-type]
    with EnvPool(SLEEPY, workers=4, slots=2) as few:
        assert few.workers == 2  # no idle workers
    sync = SyncEnvPool(SLEEPY, slots=2)
    assert isinstance(sync.step_many({1: "wave"})[1], EnvError)  # no episode yet
    assert sync.reset(1, "a").observation == "awake"
    assert sync.step(1, "wave").observation == "did wave"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers signal 0; the pool reaps its workers, so check the state too
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
