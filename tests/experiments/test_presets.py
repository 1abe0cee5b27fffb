"""Experiment presets and the job matrix: every preset validates and dry-runs without models or
data; every preset runs end to end with a scripted model in place of theirs; a failed job
is recorded and the matrix goes on; --resume plays only what is unfinished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import matrix
from experiments.cli import main
from experiments.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = "eval_out_of_distribution"
PRESETS = {
    "paper", "paper-code", "paper-llm", "scale", "scale-cpu", "scale-cpu-valid-seen", "open-vs-api",
    "explore", "textworld",
}  # fmt: skip


def cli(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    env["HOME"] = str(home)  # generated games go to $HOME/.cache: keep them in the test's dir
    return subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=home, env=env,
    )  # fmt: skip


def jobs_of(name: str) -> dict[str, dict]:
    preset = matrix.load_preset(name)
    return {j.name: matrix.job_config(preset, j, {}, Path("runs")).to_dict() for j in preset.jobs}


def test_every_preset_loads_and_keeps_the_protocol():
    assert PRESETS <= set(matrix.preset_names())
    for name in PRESETS:
        assert matrix.load_preset(name).is_matrix, name

    paper = jobs_of("paper")
    assert set(paper) == {"react", "reflexion"}
    for cfg in paper.values():
        assert (cfg["split"], cfg["trials"], cfg["memory_size"], cfg["evaluator"]) == (
            SPLIT, 12, 3, "paper",
        )  # fmt: skip
        assert cfg["max_steps"] == 30 and cfg["serve"] and cfg["model"].startswith("vllm:")
    assert {c["agent"] for c in paper.values()} == {"react", "reflexion"}
    assert {c["evaluator"] for c in jobs_of("paper-code").values()} == {"code"}
    assert {c["evaluator"] for c in jobs_of("paper-llm").values()} == {"llm"}
    assert matrix.load_preset("paper-code").needs_data

    scale = jobs_of("scale")
    models = {c["model"] for c in scale.values()}
    assert {
        "vllm:HuggingFaceH4/starchat-beta", "vllm:Qwen/Qwen2.5-7B-Instruct",
        "vllm:meta-llama/Llama-3.1-8B-Instruct", "vllm:Qwen/Qwen2.5-14B-Instruct",
        "vllm:Qwen/Qwen2.5-72B-Instruct-AWQ",
    } == models  # fmt: skip
    for m in models:  # both arms on every rung, served, same protocol
        assert {c["agent"] for c in scale.values() if c["model"] == m} == {"react", "reflexion"}
    assert all(c["serve"] and c["trials"] == 12 for c in scale.values())

    cpu = jobs_of("scale-cpu")
    assert {c["model"] for c in cpu.values()} == {"embedded:gemma3-270m", "embedded:smollm2-135m"}
    assert all(c["data"] is None and not c["serve"] and c["games"] <= 6 for c in cpu.values())
    cpu_vs = jobs_of("scale-cpu-valid-seen")
    assert {c["model"] for c in cpu_vs.values()} == {c["model"] for c in cpu.values()}
    assert matrix.load_preset("scale-cpu-valid-seen").needs_data
    for c in [*cpu.values(), *cpu_vs.values()]:  # the paper protocol on the CPU rungs too
        assert (c["evaluator"], c["memory_size"], c["max_steps"]) == ("paper", 3, 30)

    api = jobs_of("open-vs-api")
    kinds = {c["model"].split(":")[0] for c in api.values()}
    assert kinds == {"vllm", "openai", "anthropic"}
    assert all(c["serve"] == c["model"].startswith("vllm:") for c in api.values())
    assert len({(c["split"], c["trials"], c["max_steps"], c["agent"]) for c in api.values()}) == 1

    assert {c["agent"] for c in jobs_of("explore").values()} == {"reflexion", "reflexion+explore"}
    tw = jobs_of("textworld")
    assert all(c["env"] == "textworld" and c["data"] is None for c in tw.values())


def test_dry_run_of_every_preset_needs_neither_models_nor_data(tmp_path, monkeypatch, capsys):
    import experiments.games as games

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setattr(games, "DEFAULT_GAMES", tmp_path / "games")
    for name in sorted(PRESETS):
        assert main(["run", "--config", name, "--dry-run"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["preset"] == name and plan["jobs"]
        for job in plan["jobs"]:
            for key in ("games", "arm", "trials", "model", "estimated_requests"):
                assert key in job, (name, key)
            assert job["estimated_requests"]["actor_steps_at_most"] == (
                job["games"] * job["trials"] * job["max_steps"]
            )
        if name == "paper":
            assert [j["games"] for j in plan["jobs"]] == [134, 134]
            note = plan["jobs"][0]["games_note"]
            assert note.startswith(f"134 games of {SPLIT} (data not present")
            assert plan["jobs"][0]["serve"]["command"].startswith(
                "vllm serve Qwen/Qwen2.5-14B-Instruct --host 127.0.0.1 --port 8000"
            )
        if name == "scale-cpu":
            assert "generated on first run" in plan["jobs"][0]["games_note"]
        if name == "textworld":
            assert "TextWorld games generated on first run" in plan["jobs"][0]["games_note"]
    # a preset's path works as well as its name
    assert main(["run", "--config", str(matrix.preset_dir() / "explore.yaml"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] == "explore"
    assert not (tmp_path / "games").exists()  # nothing was generated
    assert "vllm" not in sys.modules


def test_dry_run_by_bare_name_from_the_command_line(tmp_path, generated_games):
    r = cli("--config", "paper", "--dry-run", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [j["games"] for j in json.loads(r.stdout)["jobs"]] == [134, 134]
    r = cli(
        "--config", "paper", "--dry-run", "--data", str(generated_games), "--model",
        "scripted:expert", home=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for job in plan["jobs"]:
        assert job["games"] == 6 and len(job["games_by_type"]) == 6 and "serve" not in job
        assert job["model"] == "scripted:expert" and job["trials"] == 12
    assert not (tmp_path / ".cache").exists()
    r = cli("--config", "no-such-preset", "--dry-run", home=tmp_path)
    assert r.returncode == 2 and "presets are" in r.stderr and "paper" in r.stderr


def test_paper_matrix_runs_both_arms_with_a_scripted_model(generated_games, tmp_path):
    run_dir = tmp_path / "paper"
    r = cli(
        "--config", "paper", "--model", "scripted:expert", "--data", str(generated_games),
        "--games", "2", "--trials", "2", "--run-dir", str(run_dir), home=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((run_dir / "matrix.json").read_text())
    assert {n: j["status"] for n, j in state["jobs"].items()} == {
        "react": "complete",
        "reflexion": "complete",
    }
    from experiments.store import RunStore

    for name, arm in (("react", "react"), ("reflexion", "reflexion")):
        store = RunStore(run_dir / name, readonly=True)
        try:
            cfg = store.get_meta("manifest")["config"]
            assert (cfg["agent"], cfg["games"], cfg["trials"], cfg["memory_size"]) == (arm, 2, 2, 3)
            assert cfg["serve"] is False and cfg["model"] == "scripted:expert"
            assert len({e.game for e in store.episodes() if e.won}) == 2
        finally:
            store.close()
    comparison = json.loads((run_dir / "report" / "comparison.json").read_text())
    assert sorted(row["arm"] for row in comparison["runs"]) == ["react", "reflexion"]
    assert f"report: {run_dir / 'report'}" in r.stdout

    # resuming a complete matrix runs nothing again
    again = cli("--resume", str(run_dir), home=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "react: complete" in again.stdout and "trial 0" not in again.stderr


@pytest.mark.parametrize(
    "name", sorted(PRESETS - {"paper", "textworld"})
)  # those two: above, below
def test_every_preset_runs_to_completion_with_a_scripted_model(name, generated_games, tmp_path):
    run_dir = tmp_path / name
    code = main([
        "run", "--config", name, "--model", "scripted:expert", "--data", str(generated_games),
        "--split", SPLIT, "--games", "1", "--trials", "1", "--run-dir", str(run_dir),
    ])  # fmt: skip
    assert code == 0
    state = json.loads((run_dir / "matrix.json").read_text())
    assert set(state["jobs"]) == {job.name for job in matrix.load_preset(name).jobs}
    assert {j["status"] for j in state["jobs"].values()} == {"complete"}
    summary = json.loads((run_dir / "report" / "comparison.json").read_text())["runs"]
    assert {row["solved_last"] for row in summary} == {
        1
    }  # the expert wins its one game in every job


@pytest.mark.slow
def test_textworld_matrix_runs_on_generated_games(tmp_path):
    run_dir = tmp_path / "tw"
    r = cli(
        "--config", "textworld", "--model", "scripted:expert", "--games", "2", "--trials", "1",
        "--run-dir", str(run_dir), home=tmp_path, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((run_dir / "matrix.json").read_text())
    assert {j["status"] for j in state["jobs"].values()} == {"complete"}
    summary = json.loads((run_dir / "report" / "comparison.json").read_text())["runs"]
    assert [row["total_tasks"] for row in summary] == [2, 2]
    assert (tmp_path / ".cache" / "reflexsim" / "games" / "textworld-seed0-n2").is_dir()


def test_a_failed_job_is_recorded_the_matrix_goes_on_and_resume_finishes_it(
    generated_games, tmp_path
):
    preset = tmp_path / "two.yaml"
    preset.write_text(
        "description: one broken job\n"
        f"base: {{data: {generated_games}, split: {SPLIT}, games: 1, trials: 1, agent: react}}\n"
        "jobs:\n"
        "  - {name: broken, model: 'scripted:replay:/nonexistent'}\n"
        "  - {name: fine, model: 'scripted:expert'}\n"
    )
    run_dir = tmp_path / "m"
    r = cli("--config", str(preset), "--run-dir", str(run_dir), home=tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    state = json.loads((run_dir / "matrix.json").read_text())
    broken, fine = state["jobs"]["broken"], state["jobs"]["fine"]
    assert broken["status"] == "failed"
    assert broken["error"].startswith("SpecError: scripted:replay: no run store")
    assert fine["status"] == "complete"
    assert "broken: failed" in r.stdout and "fine: complete" in r.stdout
    fine_db = (run_dir / "fine" / "run.sqlite").stat().st_mtime_ns

    # the fix goes on the command line; the complete job is not run again
    r = cli("--resume", str(run_dir), "--model", "scripted:expert", home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((run_dir / "matrix.json").read_text())
    assert {n: j["status"] for n, j in state["jobs"].items()} == {
        "broken": "complete",
        "fine": "complete",
    }
    assert (run_dir / "fine" / "run.sqlite").stat().st_mtime_ns == fine_db
    assert state["report"] == str(run_dir / "report")

    # the same run dir without --resume is refused
    r = cli("--config", str(preset), "--run-dir", str(run_dir), home=tmp_path)
    assert r.returncode == 2 and "already holds a matrix: use --resume" in r.stderr


def test_preset_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: {trials: 2}\njobs: [{name: a, agent: nope}]\n")
    with pytest.raises(ConfigError, match="unknown agent 'nope'"):
        matrix.load_preset(str(bad))
    bad.write_text("base: {trials: 2}\njobs: [{name: a}, {name: a}]\n")
    with pytest.raises(ConfigError, match="two jobs are named 'a'"):
        matrix.load_preset(str(bad))
    bad.write_text("base: {trials: 2}\nruns: []\njobs: [{name: a}]\n")
    with pytest.raises(ConfigError, match="unknown top-level key"):
        matrix.load_preset(str(bad))
    bad.write_text("base: {trials: 2}\njobs: [{name: '../a'}]\n")
    with pytest.raises(ConfigError, match="job name"):
        matrix.load_preset(str(bad))


def test_flags_override_every_job_and_one_deadline_covers_the_matrix():
    preset = matrix.load_preset("scale")
    flags = {"model": "scripted:expert", "games": 3, "deadline": "2h", "run_dir": "x"}
    start = time.time()
    configs = [matrix.job_config(preset, j, flags, Path("out"), start) for j in preset.jobs]
    assert {c.models.model for c in configs} == {"scripted:expert"}
    assert not any(c.server.serve for c in configs)  # serve: true is for vllm: models only
    assert {c.gameset.games for c in configs} == {3}
    assert [c.execution.run_dir for c in configs] == [
        str(Path("out") / j.name) for j in preset.jobs
    ]
    assert (
        len({c.budget.deadline for c in configs}) == 1
    )  # an absolute time, the same for every job
    from datetime import datetime

    assert datetime.fromisoformat(str(configs[0].budget.deadline)).timestamp() == pytest.approx(
        start + 7200, abs=1.5
    )
    with pytest.raises(ConfigError, match="vllm: model"):
        matrix.job_config(preset, preset.jobs[0], {"model": "openai:x", "serve": True}, Path("o"))


def _trials_played(job_dir: Path) -> dict[str, list[int]]:
    from experiments.store import open_reader

    with open_reader(job_dir) as reader:
        played: dict[str, list[int]] = {}
        for e in reader.episodes():
            played.setdefault(e.game, []).append(e.trial)
    return {game: sorted(trials) for game, trials in played.items()}


def test_a_resumed_preset_plays_the_trials_and_budget_it_is_given_now(generated_games, tmp_path):
    """``--resume MATRIX --trials 3`` of a preset run with 2 plays trial 2 of every job, as a
    single run's resume does; a larger token budget goes on where the smaller one stopped."""
    preset = tmp_path / "two.yaml"
    preset.write_text(
        "description: tasks the model never solves\n"
        f"base: {{data: {generated_games}, split: {SPLIT}, games: 2, trials: 2, max_steps: 4,"
        " model: 'scripted:ruled'}\n"
        "jobs:\n"
        "  - {name: react, agent: react}\n"
        "  - {name: reflexion, agent: reflexion}\n"
    )
    run_dir = tmp_path / "m"
    assert main(["run", "--config", str(preset), "--run-dir", str(run_dir)]) == 0
    for job in ("react", "reflexion"):
        assert set(map(tuple, _trials_played(run_dir / job).values())) == {(0, 1)}
        assert matrix.job_status(run_dir / job) == "complete"

    assert main(["run", "--resume", str(run_dir), "--trials", "3"]) == 0
    state = json.loads((run_dir / "matrix.json").read_text())
    assert state["flags"]["trials"] == 3
    assert {n: j["status"] for n, j in state["jobs"].items()} == {
        "react": "complete",
        "reflexion": "complete",
    }
    for job in ("react", "reflexion"):
        played = _trials_played(run_dir / job)
        assert len(played) == 2 and set(map(tuple, played.values())) == {(0, 1, 2)}, (job, played)

    # a budget that stops the first job part way; a resume with a larger one finishes it
    budget_dir = tmp_path / "budget"
    code = main(["run", "--config", str(preset), "--run-dir", str(budget_dir),
                 "--budget-tokens", "50"])  # fmt: skip
    assert code == 0
    assert matrix.job_status(budget_dir / "react") == "stopped"
    assert main(["run", "--resume", str(budget_dir), "--budget-tokens", "10000000"]) == 0
    for job in ("react", "reflexion"):
        assert matrix.job_status(budget_dir / job) == "complete"
        assert set(map(tuple, _trials_played(budget_dir / job).values())) == {(0, 1)}
