"""Measure the in-process vLLM backend on CPU: engine load, batch 1 vs 4, prefix-cache effect.

    .venv-vllm/bin/python scripts/bench_vllm_cpu.py --model ~/.cache/reflexsim/gemma3-270m-hf

Everything is measured side by side in one run and reported as medians of ``--repeats``; the
ratios are the numbers to compare (the machine is shared and noisy). Every timed prompt starts
with a unique line, so nothing is served from the prefix cache unless the case is about it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from itertools import count
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_smoke import GAMES, engine_options, first_prompt  # noqa: E402

from agents.llm.base import Completion, GenerationConfig, Request  # noqa: E402
from agents.llm.vllm_backend import VLLMBackend  # noqa: E402

# A fixed number of new tokens per request (no stop string) so the cases do equal work.
CONFIG = GenerationConfig(temperature=0.0, max_tokens=16, stop=(), seed=0)
_fresh = count()


def fresh(game: int = 0) -> str:
    """A ReAct prompt whose first line is new, so no cached block can match it."""
    return f"Run {next(_fresh)}.\n" + first_prompt(GAMES[game % len(GAMES)])


def call(backend: VLLMBackend, prompts: list[str]) -> tuple[float, list[Completion]]:
    started = time.perf_counter()
    out = backend.generate([Request(config=CONFIG, prompt=p) for p in prompts])
    return time.perf_counter() - started, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    backend = VLLMBackend(str(args.model), **engine_options(args))
    started = time.perf_counter()
    backend.load()
    load_s = time.perf_counter() - started
    call(backend, [fresh()])  # warm-up, not timed

    b1: list[float] = []
    b4: list[float] = []
    cold: list[float] = []
    warm: list[float] = []
    grown: list[float] = []
    grown_cold: list[float] = []
    cached: list[int] = []
    tokens: list[int] = []
    try:
        for _ in range(args.repeats):
            t, out = call(backend, [fresh()])
            b1.append(t)
            t, out = call(backend, [fresh(g) for g in range(4)])
            b4.append(t)
            tokens.append(sum(c.completion_tokens for c in out))

            prompt = fresh()
            t, _ = call(backend, [prompt])
            cold.append(t)
            t, out = call(backend, [prompt])  # the same prompt again: served from the cache
            warm.append(t)
            cached.append(out[0].cached_tokens)
            step = " go to desk 1\nYou arrive at desk 1. On the desk 1, you see a pen 1.\n>"
            t, _ = call(backend, [prompt + step])  # the next step of that episode
            grown.append(t)
            t, _ = call(backend, [fresh() + step])  # same length, nothing cached
            grown_cold.append(t)
    finally:
        backend.close()

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    result: dict[str, Any] = {
        "load_s": round(load_s, 2),
        "repeats": args.repeats,
        "batch1_s": round(med(b1), 3),
        "batch4_s": round(med(b4), 3),
        "batch4_over_batch1": round(med(b4) / med(b1), 2),
        "throughput_gain_batch4": round(4 * med(b1) / med(b4), 2),
        "batch4_new_tokens": int(statistics.median(tokens)),
        "cold_prompt_s": round(med(cold), 3),
        "same_prompt_again_s": round(med(warm), 3),
        "cold_over_cached": round(med(cold) / med(warm), 2),
        "cached_tokens_same_prompt": int(statistics.median(cached)),
        "next_step_cached_s": round(med(grown), 3),
        "next_step_uncached_s": round(med(grown_cold), 3),
        "uncached_over_cached_next_step": round(med(grown_cold) / med(grown), 2),
        "describe": backend.describe(),
    }
    print(f"engine load: {result['load_s']} s")
    print(
        f"batch 1: {result['batch1_s']} s   batch 4: {result['batch4_s']} s   "
        f"ratio {result['batch4_over_batch1']} (throughput x{result['throughput_gain_batch4']})"
    )
    print(
        f"prefix cache, same prompt: cold {result['cold_prompt_s']} s, again "
        f"{result['same_prompt_again_s']} s ({result['cached_tokens_same_prompt']} cached tokens), "
        f"ratio {result['cold_over_cached']}"
    )
    print(
        f"prefix cache, next step: cached {result['next_step_cached_s']} s, uncached "
        f"{result['next_step_uncached_s']} s, ratio {result['uncached_over_cached_next_step']}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
