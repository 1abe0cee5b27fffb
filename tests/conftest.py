"""Shared fixtures: real ALFWorld games (skipped when absent), generated games (always), and a
headless Chromium for the viewer (skipped without it)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import launch

# A suite started in the background by a non-interactive shell (`nohup ... &`, a CI step) inherits
# SIGINT ignored, and so would every process the tests start: the tests that press Ctrl-C on a
# run or a viewer would see it ignored. The tests run as from a terminal: Python's own handler
# here (its processes start with the default action, and install theirs).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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


def _one_game_per_type(factory: pytest.TempPathFactory, split: str, seed: int) -> Path:
    from envs.alfgen import generate  # the generator's libraries load only for tests that play

    root = factory.mktemp(split)
    generate(root, per_type=1, seed=seed, split=split)
    return root


@pytest.fixture(scope="session")
def generated_games(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated game per task type, in the eval_out_of_distribution split."""
    return _one_game_per_type(tmp_path_factory, "eval_out_of_distribution", seed=7)


@pytest.fixture(scope="session")
def train_games(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated game per task type, in the train split (a gathering run's games)."""
    return _one_game_per_type(tmp_path_factory, "train", seed=3)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that drives the real browser is in the slow set, however it asks for it (the
    ``browser`` marker or fixture): the `-m` selection that follows sees the mark."""
    for item in items:
        if item.get_closest_marker("browser") or "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium context (tests.support.browser), one per test module."""
    with launch(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context
