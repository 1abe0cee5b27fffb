"""The overnight runner: kill -9 and resume, faults, a killed worker, CLI errors, export."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.config import RunConfig
from experiments.session import run
from experiments.store import RunStore
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.processes import wait_dead

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = "eval_out_of_distribution"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def snapshot(run_dir: Path) -> dict:
    """Everything that must be identical between an interrupted and an uninterrupted run."""
    store = RunStore(run_dir, readonly=True)
    try:
        episodes = {
            e.episode_id: (
                e.game,
                e.trial,
                e.status,
                e.won,
                e.failure_class,
                e.verdict,
                e.prompt_prefix,
                e.memory_json,
            )
            for e in store.episodes()
        }
        steps = {
            eid: [
                (s.index, s.kind, s.raw_output, s.action, s.observation, s.admissible, s.won)
                for s in store.steps(eid)
            ]
            for eid in episodes
        }
        reflections = [(r.task, r.trial, r.text, r.prompt_hash) for r in store.reflections()]
        counts = store.conn.execute(
            "SELECT COUNT(*), COUNT(DISTINCT episode_id || '/' || idx) FROM steps"
        ).fetchone()
        return {
            "episodes": episodes,
            "steps": steps,
            "reflections": reflections,
            "rows": tuple(counts),
        }
    finally:
        store.close()


def steps_written(run_dir: Path) -> int:
    """Steps a run (perhaps one in progress, perhaps not started) has committed."""
    try:
        with sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_kill9_at_random_moments_then_resume_gives_identical_results(generated_games, tmp_path):
    args = ["--model", "scripted:learner", "--data", str(generated_games), "--split", SPLIT,
            "--games", "4", "--trials", "2", "--max-steps", "20", "--workers", "2", "--concurrency", "3"]  # fmt: skip
    reference = tmp_path / "reference"
    r = cli(*args, "--run-dir", str(reference))
    assert r.returncode == 0, r.stderr
    interrupted = tmp_path / "interrupted"
    rng = random.Random(1234)
    kills = 0
    started = False
    while kills < 10:
        cmd = [sys.executable, str(ROOT / "run_alfworld.py"), *args]
        cmd += ["--resume", str(interrupted)] if started else ["--run-dir", str(interrupted)]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        # a random moment once this process has written 1-3 steps of its own: every round makes
        # progress however slowly the machine starts processes, and the kills spread over the
        # run however fast it plays (a wait in seconds let one process finish the whole run)
        target = steps_written(interrupted) + rng.randint(1, 3)
        deadline = time.monotonic() + 120
        while proc.poll() is None and steps_written(interrupted) < target:
            assert time.monotonic() < deadline, "the run wrote no step in 120 s"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            break
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its env workers, at once
        proc.wait()
        kills += 1
        started = started or (interrupted / "run.sqlite").exists()
    r = cli(*args, "--resume", str(interrupted))
    assert r.returncode == 0, r.stderr
    assert kills >= 3, f"only {kills} kills landed while the run was going"
    a, b = snapshot(reference), snapshot(interrupted)
    assert b["rows"][0] == b["rows"][1]  # no step written twice
    assert a["episodes"] == b["episodes"]
    assert a["steps"] == b["steps"]
    assert a["reflections"] == b["reflections"]
    print(f"\nkilled {kills} times; {len(b['episodes'])} episodes, {b['rows'][0]} steps identical")


def _look(prompt: str) -> str:
    return " look"


def test_fault_injecting_model_server_errors_are_infra_not_agent_failures(
    generated_games, tmp_path
):
    plan = FaultPlan(rate=0.2, seed=3, timeout_s=1.0, retry_after="0")
    with FaultServer(plan, answer=_look) as server:
        cfg = RunConfig.of(
            model="openai:test", base_url=server.url, data=str(generated_games), split=SPLIT,
            trials=2, max_steps=10, workers=2, concurrency=6, run_dir=str(tmp_path / "run"),
            backend_options={"max_retries": 0, "timeout": 0.5, "backoff_base": 0.01, "jitter": 0.0},
        )  # fmt: skip
        run_dir = run(cfg)
        stats = server.stats()
    store = RunStore(run_dir, readonly=True)
    episodes = store.episodes()
    errored = [e for e in episodes if e.status == "error"]
    done = [e for e in episodes if e.status == "done"]
    assert errored, f"with no retries some requests must fail ({stats})"
    assert all(e.failure_class == "infra_error" and not e.won and e.error for e in errored)
    assert all(e.failure_class != "infra_error" for e in done)
    assert {e.failure_class for e in done} <= {"repeated_action"}  # " look" forever
    assert store.events("infra_error")
    print(f"\n{len(errored)} infra-error episodes, {len(done)} agent episodes; server: {stats}")


def test_retries_recover_every_request(generated_games, tmp_path):
    plan = FaultPlan(rate=0.2, seed=4, timeout_s=1.0, retry_after="0")
    with FaultServer(plan, answer=_look) as server:
        cfg = RunConfig.of(
            model="openai:test", base_url=server.url, data=str(generated_games), split=SPLIT,
            trials=1, max_steps=10, workers=2, concurrency=6, run_dir=str(tmp_path / "run"),
            backend_options={"max_retries": 8, "timeout": 0.5, "backoff_base": 0.01, "jitter": 0.0},
        )  # fmt: skip
        run_dir = run(cfg)
    store = RunStore(run_dir, readonly=True)
    assert all(e.status == "done" for e in store.episodes())
    assert store.events("retry")


class _KillingBackend:
    """Scripted expert text; once an episode has taken two actions, it SIGKILLs that episode's
    env worker (once), while the model is answering."""

    def __init__(self, pool, truth) -> None:
        from agents.llm import make_backend

        self.inner = make_backend("scripted:expert", ground_truth=truth)
        self.name = "killer"
        self.pool = pool
        self.killed = False

    def generate(self, requests):
        slot = next((s for s in range(self.pool.slots) if len(self.pool.actions(s)) >= 2), None)
        if not self.killed and slot is not None:
            victim = self.pool.pid(slot)
            os.kill(victim, signal.SIGKILL)
            self.killed = True
            wait_dead(victim)  # the episode's next step finds its worker gone
        return self.inner.generate(requests)

    def close(self) -> None:
        self.inner.close()


def test_worker_killed_mid_episode_is_resimulated(generated_games, tmp_path):
    import asyncio

    from agents.react import ReActAgent
    from agents.reflexion import ReflexionSettings
    from envs.aio import AsyncEnvPool
    from envs.pool import EnvPool, EnvSpec
    from experiments.arming import actor_settings
    from experiments.engine import Engine, ModelClient
    from experiments.games import select_games
    from experiments.trials import TrialLoop, TrialPlan

    cfg = RunConfig.of(
        model="scripted:expert", data=str(generated_games), split=SPLIT, games=2, trials=1
    )
    games = select_games(cfg)
    store = RunStore(tmp_path / "run", create=True)
    pool = EnvPool(EnvSpec(games.env_kind, games.env_kwargs), workers=2, timeout_s=60)

    async def play() -> str | None:
        backend = _KillingBackend(pool, games.ground_truth)
        engine = Engine(store, ModelClient(backend), AsyncEnvPool(pool), arm="reflexion")
        plan = TrialPlan(trials=1, reflexion=ReflexionSettings(3, "x"))
        return await TrialLoop(store, engine, ReActAgent(actor_settings(cfg)), plan).run(
            games.tasks
        )

    try:
        assert asyncio.run(play()) is None
    finally:
        pool.close()
    episodes = store.episodes()
    assert len(episodes) == 2 and all(e.won for e in episodes)
    assert sum(e.resimulated for e in episodes) == 1
    assert len(store.events("worker_crash")) == 1


def _outcomes(run_dir: Path) -> dict:
    snap = snapshot(run_dir)
    return {eid: (ep, snap["steps"][eid]) for eid, ep in snap["episodes"].items()}


def test_a_request_that_always_fails_ends_only_its_own_episodes(generated_games, tmp_path):
    """One game's requests fail permanently: exactly its episodes are infrastructure errors,
    every other episode is what it is in a clean run."""

    def cfg(url: str, name: str) -> RunConfig:
        return RunConfig.of(
            model="openai:test", base_url=url, data=str(generated_games), split=SPLIT, trials=2,
            max_steps=8, workers=2, concurrency=6, run_dir=str(tmp_path / name),
            backend_options={"max_retries": 1, "timeout": 5, "backoff_base": 0.01, "jitter": 0.0},
        )  # fmt: skip

    with FaultServer(FaultPlan(), answer=_look) as server:
        clean = run(cfg(server.url, "clean"))
    store = RunStore(clean, readonly=True)
    victim = store.episodes()[2]
    store.close()
    with FaultServer(FaultPlan(always_fail=victim.task), answer=_look) as server:
        faulty = run(cfg(server.url, "faulty"))
    a, b = _outcomes(clean), _outcomes(faulty)
    lost = {eid for eid, (ep, _) in b.items() if ep[0] == victim.game}
    assert lost == {f"{victim.game}#t0"}  # its chain stops at the failed episode
    (ep, steps) = b[f"{victim.game}#t0"]
    assert ep[2] == "error" and ep[4] == "infra_error" and steps == []
    others = {eid: v for eid, v in a.items() if not eid.startswith(victim.game)}
    assert others and {eid: b[eid] for eid in others} == others
    store = RunStore(faulty, readonly=True)
    errors = [e for e in store.events("infra_error")]
    assert errors and all(e["episode_id"] == f"{victim.game}#t0" for e in errors)
    store.close()


def test_cli_errors_are_one_line_with_exit_code_2(generated_games, tmp_path):
    ok = cli("--help")
    assert ok.returncode == 0 and "--model" in ok.stdout
    cases = [
        (["--bogus-flag"], "unrecognized arguments"),
        (["--data", str(tmp_path / "missing"), "--model", "scripted:expert"], "does not exist"),
        (["--model", "nope:x", "--data", str(generated_games), "--split", SPLIT], "nope"),
        (
            ["--model", "scripted:expert", "--data", str(generated_games), "--split", "bogus"],
            "invalid choice: 'bogus'",
        ),
    ]
    for args, needle in cases:
        r = cli(*args, "--run-dir", str(tmp_path / "never"))
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) <= 3, r.stderr  # usage + one error line at most
    base = [
        "--model",
        "scripted:expert",
        "--data",
        str(generated_games),
        "--split",
        SPLIT,
        "--games",
        "1",
        "--trials",
        "1",
    ]
    first = tmp_path / "first"
    assert cli(*base, "--run-dir", str(first)).returncode == 0
    r = cli("--resume", str(first), "--max-steps", "7")
    assert r.returncode == 2 and "different setup" in r.stderr and "max_steps" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = cli("--resume", str(first), "--max-steps", "7", "--force")
    assert r.returncode == 0, r.stderr


def test_export_reads_back(generated_games, tmp_path):
    pd = pytest.importorskip("pandas")
    cfg = RunConfig.of(model="scripted:learner", data=str(generated_games), split=SPLIT, games=2, trials=2,
                    workers=2, run_dir=str(tmp_path / "run"))  # fmt: skip
    run_dir = run(cfg)
    from experiments.export import export

    jl_episodes, jl_steps = export(run_dir, "jsonl")
    cs_episodes, cs_steps = export(run_dir, "csv", tmp_path / "csv")
    episodes = [json.loads(line) for line in jl_episodes.read_text().splitlines()]
    steps = [json.loads(line) for line in jl_steps.read_text().splitlines()]
    assert len(episodes) == 4 and {e["trial"] for e in episodes} == {0, 1}
    with cs_steps.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(steps) and rows[0]["episode_id"] == steps[0]["episode_id"]
    df = pd.read_csv(cs_episodes)
    assert int(df["won"].sum()) == 2
    assert len(pd.read_json(jl_steps, lines=True)) == len(steps)


def test_progress_written_to_a_file_is_a_plain_line_at_most_every_interval():
    """An overnight batch's log (stderr not a terminal) gets plain progress lines with the
    solved count and an ETA, throttled, and no carriage returns."""
    import io

    from experiments.cli import ConsoleProgress

    now = [0.0]
    out = io.StringIO()
    progress = ConsoleProgress(stream=out, every_s=60, clock=lambda: now[0])
    progress.start(tasks=4, episodes_at_most=8, solved=0)
    for t, won in ((30, False), (70, True), (100, False), (200, False)):
        now[0] = t
        progress.episode_done(won, tokens=1000 * t)
        if won:
            progress.task_done(True, episodes_saved=1)  # won in trial 0: one episode fewer
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        # not at 30 s; the task won at 70 s counts once its trial loop is done with it
        "  episodes 2/8, solved 0/4, 70,000 tokens, 1m10s elapsed, ETA 3m30s",
        "  episodes 4/7, solved 1/4, 200,000 tokens, 3m20s elapsed, ETA 2m30s",  # not at 100 s
        "solved 1/4 tasks",
    ]
