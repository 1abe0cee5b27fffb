"""The extract phase and the order of the phases: a run that shows rules makes them once it holds
its lock, only when the kept ones are missing or were made from other attempts; runs that start
together extract once; an unfinished gathering run is refused; a resume refuses a changed
experience; a preset job that reads another job's run waits for it to complete."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from agents.llm import make_backend
from experiments import matrix
from experiments.cli import main
from experiments.errors import ConfigError
from experiments.experience import has_rules, load, with_current_rules
from experiments.session import run
from experiments.store import RunReader
from tests.support.gameruns import game_run

HEAT = ["heat"]  # one game a split: the learner fails its first trial and wins its second


def gather(train_games: Path, tmp: Path, trials: int) -> Path:
    cfg = game_run(
        train_games, tmp, "gather", "reflexion", split="train", trials=trials,
        model="scripted:learner", max_steps=8, task_types=HEAT,
    )  # fmt: skip
    return run(cfg)


def evaluate(games: Path, tmp: Path, name: str, source: Path, **kw: object) -> Path:
    cfg = game_run(
        games, tmp, name, "insights", model="scripted:learner", max_steps=8, task_types=HEAT,
        experience_from=str(source), **kw,
    )  # fmt: skip
    return run(cfg)


def kept_rules(source: Path) -> list[str]:
    with RunReader(source) as store:
        return [r["task_type"] for r in store.get_meta("insights")["rules"]]


def test_a_changed_source_is_extracted_again_and_its_users_resume_refused(
    train_games: Path, generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gather with one trial (no win: no rules), evaluate (extracts: none); gather resumed with a
    second trial (a win): the rules are stale, the next evaluation extracts again and shows the
    heat rule; the first evaluation's resume is refused, its experience having changed."""
    source = gather(train_games, tmp_path, trials=1)
    assert not has_rules(source)
    before = evaluate(generated_games, tmp_path, "before", source)
    assert has_rules(source) and kept_rules(source) == []
    run(game_run(
        train_games, tmp_path, "gather", "reflexion", split="train", trials=2,
        model="scripted:learner", max_steps=8, task_types=HEAT,
    ), resume=str(source))  # fmt: skip
    assert not has_rules(source)  # made from the attempts before the resume
    after = evaluate(generated_games, tmp_path, "after", source)
    assert kept_rules(source) == ["heat"]
    with RunReader(after) as store:
        (episode,) = store.episodes()
        assert "For heat tasks" in episode.prompt_prefix
        assert store.get_meta("manifest")["experience"]["digest"] == load(source).provenance.digest
    code = main(["run", "--resume", str(before), "--trials", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "experience changed" in err[0], err


def test_runs_that_start_together_extract_once(
    train_games: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two runs' extract phases on one unextracted source at once: one waits for the other's
    lock and uses its rules."""
    source = gather(train_games, tmp_path, trials=2)
    experience = load(source)
    backend = make_backend("scripted:expert")
    got: list[tuple[str, ...]] = []

    def extract_phase() -> None:
        shown = with_current_rules(experience, backend, "scripted:expert", 256)
        got.append(tuple(r.text for r in shown.rules))

    with caplog.at_level(logging.INFO, logger="experiments.experience"):
        threads = [threading.Thread(target=extract_phase) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    backend.close()
    made = [r for r in caplog.records if r.getMessage().startswith("made ")]
    assert len(made) == 1, [r.getMessage() for r in caplog.records]
    assert len(got) == 2 and got[0] == got[1] and got[0]


def test_a_run_loaded_before_another_extracted_shows_that_extraction(
    train_games: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The later of two runs that start together: it loaded the source before the other made
    its rules, and asks for them after: it gets those rules (not its own empty list), and
    makes none."""
    source = gather(train_games, tmp_path, trials=2)
    loaded_early = load(source)
    assert loaded_early.rules == ()
    backend = make_backend("scripted:expert")
    try:
        first = with_current_rules(load(source), backend, "scripted:expert", 256)
        with caplog.at_level(logging.INFO, logger="experiments.experience"):
            late = with_current_rules(loaded_early, backend, "scripted:expert", 256)
    finally:
        backend.close()
    assert first.rules and late.rules == first.rules
    assert late.provenance.digest == first.provenance.digest
    assert not [r for r in caplog.records if r.getMessage().startswith("made ")]


def test_an_unfinished_gathering_run_is_refused(
    train_games: Path, generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gathering run stopped by its budget shows part of its experience: one line naming it
    and how to finish it; nothing written."""
    cfg = game_run(
        train_games, tmp_path, "gather", "reflexion", split="train", trials=2,
        model="scripted:learner", max_steps=8, budget_tokens=1, concurrency=1, workers=1,
    )  # fmt: skip
    source = run(cfg)
    with RunReader(source) as store:
        assert not store.run_state().complete
    out = tmp_path / "eval"
    code = main([
        "run", "--agent", "insights", "--data", str(generated_games), "--model",
        "scripted:learner", "--experience-from", str(source), "--run-dir", str(out),
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(source) in err[0] and f"--resume {source}" in err[0]
    assert not out.exists()


def write_preset(path: Path, train: Path, games: Path) -> Path:
    base = {
        "model": "scripted:learner", "data": str(games), "split": "eval_out_of_distribution",
        "task_types": HEAT, "max_steps": 8, "workers": 1, "concurrency": 1,
    }  # fmt: skip
    jobs = [
        {"name": "gather", "agent": "reflexion", "data": str(train), "split": "train",
         "trials": 2},
        {"name": "insights", "agent": "insights", "experience_from": "gather"},
        {"name": "react", "agent": "react"},
    ]  # fmt: skip
    path.write_text(json.dumps({"description": "phases", "base": base, "jobs": jobs}))
    return path


def test_a_job_that_reads_a_failed_job_is_left_pending(
    train_games: Path, generated_games: Path, tmp_path: Path
) -> None:
    """The gather job fails (its data holds no train games): the job that reads its run is not
    started, and says why; the others play."""
    (tmp_path / "empty").mkdir()
    path = write_preset(tmp_path / "p.json", tmp_path / "empty", generated_games)
    result = matrix.run_matrix(matrix.load_preset(str(path)), {}, tmp_path / "m")
    jobs = result.jobs
    assert jobs["gather"]["status"] == "failed"
    assert jobs["react"]["status"] == "complete"
    assert jobs["insights"]["status"] == "pending"
    assert "job gather, whose run it reads, is failed" in jobs["insights"]["note"]
    assert not (tmp_path / "m" / "insights").exists()


def test_a_job_listed_before_the_run_it_reads_is_refused(
    train_games: Path, generated_games: Path, tmp_path: Path
) -> None:
    path = write_preset(tmp_path / "p.json", train_games, generated_games)
    data = json.loads(path.read_text())
    data["jobs"].reverse()
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="list gather first"):
        matrix.run_matrix(matrix.load_preset(str(path)), {}, tmp_path / "m")
    assert not (tmp_path / "m").exists()
