"""Shared fixtures: real ALFWorld games (skipped when absent) and generated games (always)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "alfworld_data"
# REFLEXSIM_FULL_CHECKS=1: the checks that sample a large set (every real game's walkthrough, the
# long random walks) take the whole of it; CI's default run takes the seeded samples.
FULL_CHECKS = os.environ.get("REFLEXSIM_FULL_CHECKS", "") == "1"


def alfworld_data_dir() -> Path | None:
    for candidate in (os.environ.get("ALFWORLD_DATA"), str(SHARED)):
        if candidate and (Path(candidate) / "json_2.1.1").is_dir():
            return Path(candidate)
    return None


def require_alfworld_data() -> Path:
    """The real ALFWorld games' root; the calling test is skipped without them."""
    path = alfworld_data_dir()
    if path is None:
        pytest.skip("real ALFWorld games not present (set $ALFWORLD_DATA)")
    return path


@pytest.fixture(scope="session")
def alfworld_data() -> Path:
    return require_alfworld_data()


@pytest.fixture(scope="session")
def generated_games(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated game per task type, in the eval_out_of_distribution split."""
    from envs.alfgen import generate

    root = tmp_path_factory.mktemp("generated")
    generate(root, per_type=1, seed=7, split="eval_out_of_distribution")
    return root
