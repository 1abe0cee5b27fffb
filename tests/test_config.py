"""The config tree: flags, YAML keys, --help, resumable keys and the evaluator's own limits."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import (
    LEAVES,
    RESUMABLE_KEYS,
    SECTION_TYPES,
    RunConfig,
    from_mapping,
    load_yaml,
)
from experiments.errors import ConfigError
from experiments.session import run
from experiments.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
SPLIT = "eval_out_of_distribution"


def test_flat_and_nested_keys_mean_the_same():
    flat = from_mapping({"model": "scripted:expert", "trials": 5, "max-actions": 40})
    nested = from_mapping(
        {"models": {"model": "scripted:expert"}, "protocol": {"trials": 5},
         "evaluation": {"max_actions": 40}}
    )  # fmt: skip
    assert flat == nested
    assert flat.protocol.trials == 5 and flat.evaluation.max_actions == 40
    assert RunConfig.of(**flat.to_dict()) == flat  # the manifest's config reads back


def test_a_misspelled_key_is_one_line_naming_the_closest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("protocol:\n  trails: 3\n")
    with pytest.raises(ConfigError) as info:
        from_mapping(load_yaml(path), str(path))
    message = str(info.value)
    assert "protocol.trails" in message and "did you mean 'trials'" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        from_mapping({"max_stepz": 3})
    with pytest.raises(ConfigError, match="trials must be >= 1"):
        from_mapping({"trials": 0})
    with pytest.raises(ConfigError, match="use one of react"):
        from_mapping({"agent": "nope"})


def test_help_documents_every_key():
    r = subprocess.run(
        [sys.executable, str(ROOT / "run_alfworld.py"), "--help"],
        capture_output=True, text=True, cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for name, (_, f) in LEAVES.items():
        flag = f.metadata["flag"] or "--" + name.replace("_", "-")
        assert flag in text, name
        assert " ".join(f.metadata["help"].split())[:40] in text, name
    for section, kind in SECTION_TYPES.items():
        assert (kind.__doc__ or "").strip() in text, section


def test_resumable_keys_come_from_the_tree():
    assert {"trials", "workers", "concurrency", "deadline", "run_dir"} <= RESUMABLE_KEYS
    assert "max_steps" not in RESUMABLE_KEYS and "model" not in RESUMABLE_KEYS
    for section in SECTION_TYPES.values():
        for f in dataclasses.fields(section):
            assert f.metadata["help"], f.name


def _longest(run_dir: Path) -> int:
    store = RunStore(run_dir, readonly=True)
    try:
        return max(len(store.steps(e.episode_id)) for e in store.episodes())
    finally:
        store.close()


@pytest.mark.parametrize("max_actions,expected", [(30, 31), (50, 50)])
def test_max_steps_50_runs_past_31_actions_only_when_max_actions_allows(
    generated_games, tmp_path, max_actions, expected
):
    """`scripted:random` rarely wins, never repeats 4 times in a row by chance here: its
    episodes end at the evaluator's action limit (31 actions) or at the step cap (50)."""
    cfg = RunConfig.of(
        model="scripted:random", data=str(generated_games), split=SPLIT, games=1, trials=1,
        max_steps=50, max_actions=max_actions, max_repeats=50, workers=1, concurrency=1,
        run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    assert _longest(run(cfg)) == expected
