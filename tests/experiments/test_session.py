"""A run's life in one session: the run directory resolved once, games selected once, one store
handle from the lock to the end (a served run's server record included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments import games, matrix, session
from experiments.config import RunConfig
from experiments.store import RunStore
from tests.experiments.test_serve import config, no_process_on

SPLIT = "eval_out_of_distribution"


def test_an_unset_run_dir_is_the_default_one_never_a_dir_named_none(
    generated_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.of(
        model="scripted:expert", data=str(generated_games), split=SPLIT, games=1, trials=1,
        workers=1, max_steps=40,
    )  # fmt: skip
    assert cfg.execution.run_dir is None
    resolved = session.run_dir_of(cfg)
    assert resolved.parent == Path("runs") and "None" not in resolved.name
    assert session.RunSession(cfg).cfg.execution.run_dir == str(session.RunSession(cfg).run_dir)

    record = matrix.play_job(cfg)  # a job whose config names no directory
    assert record["status"] == "complete", record
    assert not (tmp_path / "None").exists()
    (made,) = (tmp_path / "runs").iterdir()
    assert matrix.job_status(made) == "complete"


def test_a_served_job_selects_its_games_once_and_opens_one_store_handle(
    generated_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    selections: list[str] = []
    real_select = games.select_games

    def select(cfg: RunConfig) -> games.GameSet:
        selections.append(str(cfg.execution.run_dir))
        return real_select(cfg)

    for module in (games, session):
        monkeypatch.setattr(module, "select_games", select)
    writers: list[Path] = []
    real_init = RunStore.__init__

    def opening(self: RunStore, run_dir: Any, **kw: Any) -> None:
        if not kw.get("readonly"):
            writers.append(Path(run_dir))
        real_init(self, run_dir, **kw)

    monkeypatch.setattr(RunStore, "__init__", opening)
    run_dir = tmp_path / "served"
    cfg = config(
        tmp_path, data=str(generated_games), split=SPLIT, games=1, trials=1, max_steps=3,
        concurrency=1, workers=1, run_dir=str(run_dir),
    )  # fmt: skip
    record = matrix.play_job(cfg, {"placement": [{"attempt": 1}]})
    assert record["status"] == "complete", record
    assert len(selections) == 1
    assert writers == [run_dir]  # created once; the server's record went through that handle
    store = RunStore(run_dir, readonly=True)
    try:
        server = store.get_meta("server")
        assert server["restarts"] == 0 and server["failed"] is None
        assert server["url"] == f"http://127.0.0.1:{cfg.server.serve_port}/v1"
        assert store.get_meta("placement") == [{"attempt": 1}]  # the caller's notes, too
    finally:
        store.close()
    assert "[reflexsim serve] stopped" in (run_dir / "server.log").read_text()
    assert no_process_on(cfg.server.serve_port, "stand_in.py")
