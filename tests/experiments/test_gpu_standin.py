"""The GPU stand-in (tests/support/gpu_standin.py): its figures against the published ones, its
prefix cache, admission and preemption on the virtual clock, and a real run through its HTTP
server. No timing is asserted: every number here is the simulator's arithmetic."""

from __future__ import annotations

import dataclasses
import json
import math
import urllib.request
from pathlib import Path

import pytest

from experiments.config import RunConfig
from experiments.session import run
from experiments.store import open_reader
from tests.support.gpu_standin import (
    H100_8B,
    H200_8B,
    Engine,
    Seq,
    actor_load,
    decode_step,
    site_of,
    standin_server,
    text_policy,
)

SPLIT = "eval_out_of_distribution"

# The worked figures, from the published ones: Llama-3.1-8B in bf16 (16 GB of weights,
# 128 KiB of KV a token) on one H100 (3.35 TB/s) decodes 128 sequences of ~1.5k tokens in ~12 ms,
# prefills ~20-25k tokens/s, answers ~500 actor requests a second at batch 128 (20 tokens each).
WEIGHTS, KV, HBM = 16e9, 128 * 1024, 3.35e12


def _within(value: float, target: float, share: float = 0.25) -> bool:
    return abs(value - target) <= share * target


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_decode_steps_match_the_published_figures(batch: int) -> None:
    step = decode_step(H100_8B, batch, 1536)
    worked = (WEIGHTS + batch * 1536 * KV) / HBM  # memory-bound: every byte read once
    assert step.decode == step.seqs == batch and step.prefill_tokens == 0
    assert _within(step.duration_s, worked), (step.duration_s, worked)
    if batch == 128:
        assert _within(step.duration_s, 0.012)
    h200 = decode_step(H200_8B, batch, 1536)  # the same bytes at 4.8 TB/s
    assert h200.duration_s == pytest.approx(step.duration_s * 3.35 / 4.8)


def test_a_prompt_prefills_at_the_compute_bound_rate() -> None:
    engine = Engine(H100_8B)
    engine.add([f"t{i}" for i in range(4096)], ["<stop>"])
    step = engine.step()
    assert step is not None and step.prefill_tokens == 4096
    assert 20_000 <= 4096 / step.duration_s <= 25_000


def test_actor_requests_at_batch_128() -> None:
    """The worked ~500 requests/s charges decode only (128 / (20 x 12 ms)); with the prefill of
    each request's ~100 new prompt tokens at the preset's rate the stand-in is compute-bound."""
    decode_only = actor_load(
        dataclasses.replace(H100_8B, prefill_tokens_per_s=math.inf), requests=600
    )
    assert _within(decode_only.requests_per_s, 500), decode_only
    assert decode_only.batch == 128 and _within(decode_only.context, 1500, 0.1)
    assert 100 <= decode_only.new_prompt_tokens <= 116  # the prefix cache serves the rest
    charged = actor_load(H100_8B, requests=600)
    per_request = charged.new_prompt_tokens + 20  # tokens computed a request
    assert _within(charged.requests_per_s, H100_8B.prefill_tokens_per_s / per_request), charged
    assert charged.requests_per_s < decode_only.requests_per_s / 2


# -- the prefix cache ------------------------------------------------------------------------------
def _play(engine: Engine, prompt: list[str], answer: int = 1) -> Seq:
    """Run one request to its end; no other is in flight."""
    seq = engine.add(prompt, [f"ans{i}" for i in range(answer - 1)] + ["<stop>"])
    while engine.step() is not None:
        pass
    assert seq.generated == seq.out_len and not engine.running and not engine.waiting
    return seq


def _tokens(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def test_prefix_cache_hits_whole_blocks_short_of_the_last_token() -> None:
    engine = Engine(H100_8B, kv_capacity_tokens=1024)
    a = _tokens("a", 40)
    assert _play(engine, a).cached_tokens == 0
    assert _play(engine, a).cached_tokens == 32  # 2 whole blocks of 16; the 3rd is partial
    assert _play(engine, a[:32]).cached_tokens == 16  # the last token is always computed
    assert _play(engine, a[:33]).cached_tokens == 32
    # a ReAct step: the last prompt, its answer (generated, cached too) and an observation
    first = _tokens("p", 40)
    seq = _play(engine, first, answer=10)  # KV for 40 + 9 tokens: 3 whole blocks
    after = first + [f"ans{i}" for i in range(9)] + ["<stop>"] + _tokens("obs", 20)
    assert _play(engine, after).cached_tokens == 48
    assert seq.cached_tokens == 0 and engine.stats()["cached_tokens"] == 32 + 16 + 32 + 48


def test_prefix_cache_evicts_the_least_recently_used_blocks() -> None:
    engine = Engine(H100_8B, kv_capacity_tokens=96)  # 6 blocks: two 33-token prompts
    a, b, c = _tokens("a", 33), _tokens("b", 33), _tokens("c", 33)
    _play(engine, a)
    _play(engine, b)
    assert _play(engine, a).cached_tokens == 32  # a is now used more recently than b
    assert engine.pool.evictions == 0
    _play(engine, c)  # takes b's blocks (and a spare one), not a's
    assert engine.pool.evictions == 2
    assert _play(engine, a).cached_tokens == 32
    assert _play(engine, b).cached_tokens == 0
    # a's tail went first, its prefix stays: a prompt sharing a's first block still hits it
    assert _play(engine, a[:16] + _tokens("d", 17)).cached_tokens == 16


# -- admission and preemption when the KV cache is full -------------------------------------------
def test_admission_waits_for_blocks_and_preemption_recomputes_the_last_admitted() -> None:
    engine = Engine(H100_8B, kv_capacity_tokens=128)  # 8 blocks
    seqs = [engine.add(_tokens(f"r{i}.", 40), _tokens("x", 29) + ["<stop>"]) for i in range(3)]
    n_blocks = len(engine.pool.refs)
    step = engine.step()
    assert step is not None and step.seqs == 2 and step.prefill_tokens == 80
    assert engine.running == seqs[:2] and list(engine.waiting) == [seqs[2]]  # 3 blocks each
    preempted: list[int] = []
    finished: list[int] = []
    while (step := engine.step()) is not None:
        preempted += step.preempted
        finished += [s.rid for s in step.finished]
        held = sum(len(s.blocks) for s in engine.running)
        assert held + len(engine.pool.free) == n_blocks  # never more than the cache
        assert sum(engine.pool.refs) == held
    assert preempted[0] == seqs[1].rid  # the last admitted gives way
    assert seqs[0].preemptions == 0 and finished[0] == seqs[0].rid
    assert engine.preemptions == len(preempted) >= 1
    assert all(s.generated == 30 for s in seqs) and engine.completion_tokens == 90
    assert len(engine.pool.free) == n_blocks
    assert engine.busy_s == pytest.approx(engine.clock) and engine.clock > 0


def test_a_request_larger_than_the_cache_is_refused() -> None:
    engine = Engine(H100_8B, kv_capacity_tokens=64)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        engine.add(_tokens("a", 64), ["<stop>"])


# -- answers from a scripted policy, read from the prompt ---------------------------------------
def test_the_random_policy_reads_places_and_history_from_the_prompt() -> None:
    prompt = (
        "Example.\n\nYou are in a room. Looking quickly around you, you see a desk 1, "
        "a drawer 2, and a bed 1.\n\nYour task is to: put a pen in drawer.\n> go to desk 1\n"
        "On the desk 1, you see a pen 1.\n>"
    )
    site = site_of(prompt)
    assert site.history == ("go to desk 1",) and site.step == 1
    assert site.admissible == ("look", "inventory", "go to desk 1", "go to drawer 2", "go to bed 1")
    answer = text_policy("random")(prompt)
    assert answer.startswith(" ") and answer.strip() in site.admissible
    assert text_policy("random")(prompt) == answer  # deterministic


# -- a real run through the HTTP path --------------------------------------------------------------
def test_a_run_against_the_served_standin(generated_games: Path, tmp_path: Path) -> None:
    with standin_server(H100_8B, policy="random", time_scale=0.01) as server:
        cfg = RunConfig.of(
            model="openai:standin", base_url=server.url, data=str(generated_games), split=SPLIT,
            games=2, trials=2, max_steps=6, workers=1, concurrency=4, run_dir=str(tmp_path / "run"),
            backend_options={"max_retries": 0},
        )  # fmt: skip
        run_dir = run(cfg)
        with urllib.request.urlopen(f"{server.root}/stats", timeout=30) as answer:
            stats = json.load(answer)
    with open_reader(run_dir) as reader:
        episodes = reader.episodes()
        calls = reader.model_calls()
        actions = [s.action for e in episodes for s in reader.steps(e.episode_id)]
    assert episodes and all(e.status == "done" for e in episodes)
    assert any(a.startswith("go to ") for a in actions)  # read from the real prompts
    assert stats["requests"] == len(calls) and stats["busy_s"] > 0 and stats["iterations"] > 0
    assert stats["preset"] == H100_8B.name and 0 < stats["busy_fraction"] <= 1
    acts = [c for c in calls if c.purpose == "act"]
    assert sum(c.cached_tokens for c in calls) == stats["cached_tokens"]
    # every step after an episode's first re-sends its prompt: the prefix cache serves most of it
    later = [c for c in acts if c.cached_tokens > 0]
    assert len(later) >= len(acts) - len(episodes)
    assert all(c.cached_tokens < c.prompt_tokens for c in acts)
