"""The config tree: flags, YAML keys, --help, resumable keys and the evaluator's own limits."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from agents.options import help_text
from experiments.config import (
    RunConfig,
    from_mapping,
    leaves,
    load_yaml,
    resumable_keys,
    section_types,
)
from experiments.errors import ConfigError
from experiments.session import run
from experiments.store import RunStore

ROOT = Path(__file__).resolve().parent.parent.parent
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
    # the arms' sections (declared in their modules) read the same both ways
    arms_flat = from_mapping({"lats_n": 3, "max_replans": 1})
    arms_nested = from_mapping({"lats": {"lats-n": 3}, "planning": {"max_replans": 1}})
    assert arms_flat == arms_nested and arms_flat.section("lats").lats_n == 3
    assert arms_flat.section("planning").max_replans == 1
    assert arms_flat.to_tree()["planning"]["max_replans"] == 1


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
    for name, (_, f) in leaves().items():
        flag = f.metadata["flag"] or "--" + name.replace("_", "-")
        assert flag in text, name
        assert " ".join(help_text(f.metadata).split())[:40] in text, name
    for section, kind in section_types().items():
        assert (kind.__doc__ or "").strip() in text, section


def test_resumable_keys_come_from_the_tree():
    assert {"trials", "workers", "concurrency", "deadline", "run_dir"} <= resumable_keys()
    assert "max_steps" not in resumable_keys() and "model" not in resumable_keys()
    for section in section_types().values():
        for f in dataclasses.fields(section):
            assert help_text(f.metadata), f.name


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


def config_renames(source: str, leaf_names: set[str], sections: set[str]) -> list[str]:
    """``field <- leaf`` for every keyword argument that passes a config leaf on under another
    name: ``Settings(field=cfg.section.leaf)``, or ``p.leaf`` where ``p = cfg.section``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        aliases = set()  # names bound to a section: p = cfg.protocol; p, e = cfg.a, cfg.b
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = (
                    zip(target.elts, value.elts, strict=False)
                    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                    else [(target, value)]
                )
                aliases |= {
                    t.id
                    for t, v in pairs
                    if isinstance(t, ast.Name) and isinstance(v, ast.Attribute)
                    and v.attr in sections
                }  # fmt: skip
        for node in ast.walk(fn):
            for kw in node.keywords if isinstance(node, ast.Call) else []:
                value = kw.value
                if not isinstance(value, ast.Attribute) or value.attr not in leaf_names:
                    continue
                base = value.value
                reads = (isinstance(base, ast.Attribute) and base.attr in sections) or (
                    isinstance(base, ast.Name) and base.id in aliases
                )
                if reads and kw.arg is not None and kw.arg != value.attr:
                    found.append(f"{kw.arg} <- {value.attr}")
    return found


def test_the_rename_count_finds_a_rename():
    code = (
        "def f(cfg):\n    p, m = cfg.protocol, cfg.models\n"
        "    return S(decoding=m.action_decoding, trials=p.trials, n=cfg.lats.lats_n)\n"
    )
    assert config_renames(code, set(leaves()), set(section_types())) == [
        "decoding <- action_decoding", "n <- lats_n",
    ]  # fmt: skip


def test_settings_take_the_config_names():
    """Where settings are built from the config (the arms' factories and the agents under
    agents/, the run's settings in experiments/arming.py), every field has its leaf's name: an
    arm's section is its settings, and the actor's, reflection's and trial settings take the
    config's names (before the arms' sections: 17 renames, e.g. lats_n -> n)."""
    sources = [*sorted((ROOT / "agents").rglob("*.py")), ROOT / "experiments" / "arming.py"]
    names, sections = set(leaves()), set(section_types())
    found = {
        str(p.relative_to(ROOT)): r
        for p in sources
        if (r := config_renames(p.read_text(), names, sections))
    }
    assert found == {}


def test_reset_cache_reaches_every_env_worker(generated_games):
    """``--reset-cache N`` (a night of many games x trials resets every game again each trial)
    is what each env the workers build keeps; by default, every game of the run (at most
    MAX_RESET_CACHE)."""
    from envs.pool import EnvSpec
    from experiments.config import MAX_RESET_CACHE
    from experiments.games import reset_cache, select_games

    for given, kept in (
        ({}, 6),  # one generated game per task type
        ({"games": 2}, 2),
        ({"reset_cache": 140}, 140),
        ({"reset_cache": 0}, 0),
    ):
        cfg = RunConfig.of(data=str(generated_games), split="eval_out_of_distribution", **given)
        games = select_games(cfg)
        env = EnvSpec(games.env_kind, games.env_kwargs).build()
        try:
            assert env.reset_cache == kept
        finally:
            env.close()
    assert reset_cache(RunConfig.of(), 3553) == MAX_RESET_CACHE
    with pytest.raises(ConfigError, match="reset-cache must be >= 0"):
        RunConfig.of(reset_cache=-1)
