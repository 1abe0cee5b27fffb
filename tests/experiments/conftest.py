"""Fixtures of the runner-process tests (``test_shards.py``, ``test_ray_shards.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.cli import main
from tests.experiments.test_signals import args_of


@pytest.fixture(scope="module")
def one_process(generated_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The signal tests' run played by one process, uninterrupted: what the others must equal."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert main(["run", *args_of(generated_games), "--run-dir", str(run_dir)]) == 0
    return run_dir
