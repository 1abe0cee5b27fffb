"""The Reflexion loop end to end on CPU: real envs, real run store, scripted model text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agents.llm.scripted import plan_text
from agents.prompting import actor_prompt
from envs.alfworld_env import game_walkthrough
from envs.textworld_env import game_walkthrough as tw_walkthrough
from experiments.config import RunConfig
from experiments.errors import RunStoreError
from experiments.progress import NoProgress
from experiments.session import run
from experiments.store import RunStore
from memory.records import StepKind


def config(games_dir: Path, tmp: Path, **kw) -> RunConfig:
    base = dict(
        model="scripted:learner",
        data=str(games_dir),
        split="eval_out_of_distribution",
        trials=3,
        max_steps=30,
        workers=2,
        concurrency=3,
        run_dir=str(tmp / "run"),
    )
    base.update(kw)
    return RunConfig.of(**base)


def solved_by_trial(store: RunStore) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in store.episodes():
        out.setdefault(e.trial, 0)
        out[e.trial] += int(e.won)
    return out


def test_learner_fails_first_trial_then_solves_with_reflection(generated_games, tmp_path):
    run_dir = run(config(generated_games, tmp_path))
    store = RunStore(run_dir, readonly=True)
    episodes = store.episodes()
    tasks = {e.game for e in episodes}
    assert len(tasks) == 6
    assert solved_by_trial(store) == {0: 0, 1: 6}  # trial 2 runs nothing: all solved
    assert {e.trial for e in episodes} == {0, 1}
    # every failure of trial 0 was stopped by the paper evaluator as a loop
    assert {e.failure_class for e in episodes if e.trial == 0} == {"repeated_action"}
    reflections = store.reflections()
    assert {(r.task, r.trial) for r in reflections} == {(g, 0) for g in tasks}
    for r in reflections:
        assert (
            r.episode_id == f"{r.task}#t0"
            and r.model == "scripted:learner"
            and len(r.prompt_hash) == 64
        )
        assert r.text.strip()
    for e in episodes:
        shown = json.loads(e.memory_json)
        assert len(shown) == (0 if e.trial == 0 else 1)
    trials = store.trials()
    assert [len(t["tasks"]) for t in trials] == [6, 6]


def test_react_arm_never_sees_memory(generated_games, tmp_path):
    store = RunStore(run(config(generated_games, tmp_path, agent="react", trials=2)), readonly=True)
    assert solved_by_trial(store) == {0: 0, 1: 0}
    assert store.reflections() == []
    assert all(json.loads(e.memory_json) == [] for e in store.episodes())


def test_solved_tasks_are_not_rerun(generated_games, tmp_path):
    store = RunStore(run(config(generated_games, tmp_path, model="scripted:expert")), readonly=True)
    assert solved_by_trial(store) == {0: 6}
    assert len(store.trials()) == 1


def test_memory_window_never_exceeds_omega(generated_games, tmp_path):
    cfg = config(
        generated_games,
        tmp_path,
        model="scripted:random",
        trials=4,
        memory_size=2,
        max_steps=6,
        games=2,
    )
    store = RunStore(run(cfg), readonly=True)
    for e in store.episodes():
        assert len(json.loads(e.memory_json)) <= 2
    failing = [
        g
        for g in {e.game for e in store.episodes()}
        if not any(x.won for x in store.episodes() if x.game == g)
    ]
    for g in failing:
        assert [r.trial for r in store.reflections(g)] == [
            0,
            1,
            2,
        ]  # all kept (none after the last trial)
        last = [e for e in store.episodes() if e.game == g and e.trial == 3][0]
        assert [r["trial"] for r in json.loads(last.memory_json)] == [1, 2]


def test_prefix_share(generated_games, tmp_path, capsys):
    store = RunStore(
        run(config(generated_games, tmp_path, model="scripted:expert", trials=1)), readonly=True
    )
    shares = []  # share of step i's prompt that step i+1's prompt starts with
    cached = []  # share of step i+1's prompt that a prefix cache already holds from step i
    for e in store.episodes():
        steps = store.steps(e.episode_id)
        history = [(s.action, s.observation) for s in steps]
        prompts = [
            actor_prompt(e.prompt_prefix, e.observation, history[:i]) for i in range(len(steps))
        ]
        for a, b in zip(prompts, prompts[1:], strict=False):
            common = len(os.path.commonprefix([a, b]))
            shares.append(common / len(a))
            cached.append(common / len(b))
    assert shares and min(shares) >= 0.95
    assert min(cached) >= 0.9
    with capsys.disabled():
        print(
            f"\nprefix share over {len(shares)} step pairs: min {min(shares):.4f};"
            f" share of the next prompt already cached: min {min(cached):.4f}, mean {sum(cached) / len(cached):.4f}"
        )


def test_deadline_stops_cleanly_and_resume_finishes(generated_games, tmp_path):
    run_dir = run(
        config(generated_games, tmp_path, model="scripted:expert", trials=1, deadline="0s")
    )
    store = RunStore(run_dir, readonly=True)
    state = store.run_state()
    assert state.status == "stopped" and "deadline" in str(state.stopped)
    assert store.episodes() == []
    store.close()
    run(config(generated_games, tmp_path, model="scripted:expert", trials=1), resume=str(run_dir))
    store = RunStore(run_dir, readonly=True)
    assert solved_by_trial(store) == {0: 6}
    assert store.run_state().complete


class Recorder(NoProgress):
    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        self.started = (tasks, episodes_at_most, solved)
        self.episodes = 0

    def episode_done(self, won: bool, tokens: int, episode: str = "") -> None:
        self.episodes += 1


def test_resume_with_more_trials_plays_only_the_new_ones(generated_games, tmp_path):
    cfg = config(generated_games, tmp_path, trials=1)
    run_dir = run(cfg)
    store = RunStore(run_dir, readonly=True)
    first = [(e.episode_id, e.finished_at) for e in store.episodes(0)]
    assert solved_by_trial(store) == {0: 0} and store.run_state().complete
    store.close()
    recorder = Recorder()
    run(config(generated_games, tmp_path, trials=2), resume=str(run_dir), progress=recorder)
    assert recorder.started == (6, 6, 0) and recorder.episodes == 6  # trial 1 only
    store = RunStore(run_dir, readonly=True)
    assert solved_by_trial(store) == {0: 0, 1: 6}  # the learner uses trial 0's reflections
    assert [(e.episode_id, e.finished_at) for e in store.episodes(0)] == first  # not replayed
    assert store.get_meta("manifest")["config"]["trials"] == 2
    # trial 0's reflections were written on resume by a backend that saw none of its episodes:
    # the backend reads the walkthrough from the game files, so the text is an uninterrupted run's
    for r in store.reflections():
        walkthrough = game_walkthrough(generated_games / r.task / "game.tw-pddl")
        assert walkthrough and r.text == plan_text(walkthrough)
    store.close()
    with pytest.raises(RunStoreError, match="resume with --trials 2 or more"):
        run(config(generated_games, tmp_path, trials=1), resume=str(run_dir))


def test_textworld_games_run_through_the_same_loop(tmp_path):
    pytest.importorskip("textworld")
    from envs.twgen import generate_textworld_games

    games = tmp_path / "tw"
    generate_textworld_games(games, n=1, seed=3)
    cfg = RunConfig.of(
        model="scripted:expert",
        env="textworld",
        data=str(games),
        trials=1,
        workers=1,
        run_dir=str(tmp_path / "run"),
    )
    store = RunStore(run(cfg), readonly=True)
    (episode,) = store.episodes()
    assert episode.won and episode.task_type == "textworld"
    steps = store.steps(episode.episode_id)
    # TextWorld keeps `put X on Y`: the ALFWorld put->move rule is off for it
    assert not any(s.action.startswith("move ") for s in steps)
    (path,) = games.glob("*.z8")  # the walkthrough read from the game file, without playing it
    acts = [s.action for s in steps if s.kind == StepKind.ACT]
    assert tw_walkthrough(path) == acts


def test_reflection_ends_where_the_model_starts_writing_transcript():
    from agents.llm.common import truncate_at_stop
    from agents.reflexion import REFLECTION_STOPS

    text = " > I need to take a creditcard, then put it in armchair 1.\n> take creditcard 1\n> go"
    assert truncate_at_stop(text, REFLECTION_STOPS)[0] == text.split("\n")[0]
    plan = "I looked in the wrong place.\nNext time I will go to desk 1 first.\n\nYou are in"
    assert truncate_at_stop(plan, REFLECTION_STOPS)[0] == plan.split("\n\n")[0]


def _react_outputs(run_dir: Path) -> dict[int, list[list[str]]]:
    store = RunStore(run_dir, readonly=True)
    try:
        out: dict[int, list[list[str]]] = {}
        for e in store.episodes():
            out.setdefault(e.trial, []).append([s.raw_output for s in store.steps(e.episode_id)])
        seeds = {(e.trial, e.seed) for e in store.episodes()}
        assert all(seed is not None for _, seed in seeds)
        assert len(seeds) == len(store.episodes())  # a seed of its own per episode
        return out
    finally:
        store.close()


@pytest.mark.slow
def test_the_resampling_baseline_resamples_and_a_seed_replays_it(generated_games, tmp_path):
    """`react` at temperature 0.8: trial 1 samples differently from trial 0 (its own seed,
    derived from run seed, game and trial); the same seed gives the same run."""

    def go(name: str) -> Path:
        return run(
            config(
                generated_games, tmp_path / name, model="embedded", agent="react", trials=2,
                games=1, max_steps=3, temperature=0.8, max_tokens=16, workers=1, concurrency=1,
                seed=11,
            )
        )  # fmt: skip

    first, again = _react_outputs(go("a")), _react_outputs(go("b"))
    assert first == again
    assert first[0] != first[1]
