"""``reflexsim export --format sft|preference``: a real Reflexion run (generated ALFWorld games,
the scripted learner, which fails a task's first trial and wins it once a reflection is in its
prompt) written as training data, checked against the store's prompts, and read back with the
``datasets`` library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.cli import main
from experiments.config import RunConfig
from experiments.prompts import step_prompts
from experiments.session import run
from experiments.store import EpisodeRow, RunReader, open_reader
from experiments.training_data import conversation, joined
from experiments.viewer.data import step_prompt
from tests.support.runfactory import COMMITTED, COMMITTED_V1, make_run, standard_tasks

SPLIT = "eval_out_of_distribution"


@pytest.fixture(scope="module")
def learner_run(generated_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three games, two trials: each task fails, reflects, then wins."""
    cfg = RunConfig.of(
        model="scripted:learner", agent="reflexion", data=str(generated_games), split=SPLIT,
        games=3, trials=2, workers=1, max_steps=12,
        run_dir=str(tmp_path_factory.mktemp("learner") / "run"),
    )  # fmt: skip
    return run(cfg)


def _export(run_dir: Path, fmt: str, out: Path, *more: str) -> int:
    return main(["export", str(run_dir), "--format", fmt, "--out", str(out), *more])


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _prompts_match(reader: RunReader, episode_id: str, messages: list[dict[str, str]]) -> int:
    """Every step's prompt, joined from ``messages``, is the one the store holds (the prompt the
    model was sent); returns the steps checked."""
    row = reader.episode(episode_id)
    assert row is not None
    steps = reader.steps(episode_id)
    assert messages[0] == {"role": "system", "content": row.prompt_prefix}
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user"] + ["assistant", "user"] * (len(steps) - 1) + ["assistant"]
    for k in range(len(steps)):
        assert joined(messages[: 2 + 2 * k]) == step_prompt(reader, row, steps, k).shown
    return len(steps)


def _conversation(reader: RunReader, row: EpisodeRow, protocol: str | None = None) -> list:
    steps = reader.steps(row.episode_id)
    messages = conversation(row, steps, step_prompts(reader, row, steps, protocol))
    assert messages is not None
    return messages


def test_sft_records_hold_each_won_episode_with_its_exact_prompts(
    learner_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _export(learner_run, "sft", tmp_path) == 0
    path = tmp_path / "sft.jsonl"
    assert capsys.readouterr().out.strip() == str(path)
    records = _lines(path)
    with open_reader(learner_run) as reader:
        won = [e for e in reader.episodes() if e.won]
        assert len(records) == len(won) == 3
        assert [r["metadata"]["episode_id"] for r in records] == [e.episode_id for e in won]
        checked = 0
        for r in records:
            meta = r["metadata"]
            assert meta["trial"] == 1 and meta["model"] == "scripted:learner"
            assert meta["arm"] == "reflexion" and meta["protocol"] == "reflexsim"
            assert meta["run"] == "run" and meta["steps"] == (len(r["messages"]) - 1) // 2
            checked += _prompts_match(reader, meta["episode_id"], r["messages"])
            # the retry's prompt shows the reflection its failed trial led to
            (reflection,) = reader.reflections(meta["game"])
            assert reflection.text.strip() in r["messages"][0]["content"]
    print(f"sft: {len(records)} records, {checked} assistant turns")


def test_preference_pairs_are_a_failed_trial_and_its_won_retry(
    learner_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "pairs.jsonl"
    assert _export(learner_run, "preference", out) == 0
    pairs = _lines(out)
    assert len(pairs) == 3
    with open_reader(learner_run) as reader:
        for p in pairs:
            chosen, rejected = p["metadata"]["chosen"], p["metadata"]["rejected"]
            assert chosen["game"] == rejected["game"]
            assert (rejected["trial"], chosen["trial"]) == (0, 1)
            rejected_row, chosen_row = (reader.episode(m["episode_id"]) for m in (rejected, chosen))
            assert rejected_row is not None and not rejected_row.won
            assert chosen_row is not None and chosen_row.won
            # the prompt is the failed trial's; the winning one saw the reflection besides
            (reflection,) = reader.reflections(chosen["game"])
            assert p["reflection"] == reflection.text and reflection.trial == rejected["trial"]
            assert p["same_prompt"] is False
            assert p["prompt"][1] == _conversation(reader, chosen_row)[1]
            _prompts_match(reader, rejected["episode_id"], p["prompt"] + p["rejected"])
            assert chosen["steps"] == len(p["chosen"]) // 2 + 1 and p["chosen"][-1]["role"] == (
                "assistant"
            )
            assert p["chosen"] != p["rejected"]
    print(f"preference: {len(pairs)} pairs")


def test_both_formats_load_with_datasets(
    learner_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    assert _export(learner_run, "sft", tmp_path) == 0
    assert _export(learner_run, "preference", tmp_path) == 0
    sft = datasets.load_dataset(
        "json", data_files=str(tmp_path / "sft.jsonl"), split="train", cache_dir=str(tmp_path / "c")
    )
    pref = datasets.load_dataset(
        "json",
        data_files=str(tmp_path / "preference.jsonl"),
        split="train",
        cache_dir=str(tmp_path / "c"),
    )
    assert sft.num_rows == 3 and set(sft.column_names) == {"messages", "metadata"}
    assert sft[0]["messages"][0]["role"] == "system"
    assert pref.num_rows == 3
    assert {"prompt", "chosen", "rejected", "reflection"} <= set(pref.column_names)
    assert pref[0]["chosen"][0]["role"] == "assistant"


def _one_error_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reflexsim: error:") and needle in lines[0], err


def test_bad_targets_and_runs_are_one_line_errors(
    learner_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sft.jsonl"
    out.write_text("keep me\n")
    _one_error_line(_export(learner_run, "sft", out), capsys.readouterr().err, "--force")
    assert out.read_text() == "keep me\n"  # nothing lost
    assert _export(learner_run, "sft", out, "--force") == 0
    assert len(_lines(out)) == 3

    unfinished = make_run(tmp_path / "unfinished", standard_tasks(), complete=False)
    cases = [
        (tmp_path / "missing", "no run directory"),
        (tmp_path, "not a run directory"),
        (unfinished, "--resume"),
    ]
    for run_dir, needle in cases:
        for fmt in ("sft", "preference"):
            code = _export(run_dir, fmt, tmp_path / "never")
            _one_error_line(code, capsys.readouterr().err, needle)
    assert not (tmp_path / "never").exists()


def test_a_store_with_loosely_written_steps_and_a_layout_that_is_not_append_only(
    tmp_path: Path,
) -> None:
    """runfactory's episodes: a thought, an invalid output, an inadmissible action and a mapped
    one. The answer is what the next prompt shows (the executed action); prompts that are not
    append-only (rebuilt here with the code protocol's layout) make no conversation."""
    run_dir = make_run(tmp_path / "run", standard_tasks())
    with open_reader(run_dir) as reader:
        won = [e for e in reader.episodes() if e.won]
        for e in won:
            messages = _conversation(reader, e)
            _prompts_match(reader, e.episode_id, messages)
            assert messages[-1]["content"] == " move apple 1 to fridge 1"
            assert messages[6]["content"] == " "  # the invalid output: its line holds nothing
        steps = reader.steps(won[0].episode_id)
        code = step_prompts(reader, won[0], steps, "reflexion-code")
        assert all(p.rebuilt for p in code)  # this store recorded no request
        assert conversation(won[0], steps, code) is None
    assert _export(run_dir, "preference", tmp_path) == 0
    pairs = _lines(tmp_path / "preference.jsonl")
    # clean: trial 0 failed; heat: trial 0 was an infrastructure error, trial 1 failed
    assert [
        (p["metadata"]["rejected"]["trial"], p["metadata"]["chosen"]["trial"]) for p in pairs
    ] == [
        (0, 1),
        (1, 2),
    ]


@pytest.mark.skipif(not COMMITTED, reason="no committed runs in this checkout")
def test_committed_stores_export_and_their_episodes_read_as_conversations(tmp_path: Path) -> None:
    """A committed run of each schema: both formats write (these models solved nothing, so the
    files are empty), and a failed episode's conversation joins to its stored prompts."""
    for run_dir in {COMMITTED_V1[0] if COMMITTED_V1 else COMMITTED[0], COMMITTED[-1]}:
        for fmt in ("sft", "preference"):
            out = tmp_path / f"{run_dir.name}-{fmt}.jsonl"
            assert _export(run_dir, fmt, out) == 0
            assert out.read_text() == ""
        with open_reader(run_dir) as reader:
            first = reader.episodes()[0]
            assert _prompts_match(reader, first.episode_id, _conversation(reader, first)) > 0
