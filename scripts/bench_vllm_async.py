"""Measure vLLM's async engine behind ``agenerate``: concurrent vs sequential requests, and the
cost of grounded decoding (structured outputs) per generated token.

    .venv-vllm/bin/python scripts/bench_vllm_async.py --model ~/.cache/reflexsim/gemma3-270m-hf

Side by side in one run, medians of ``--repeats``; compare the ratios (the machine is shared and
noisy). Every timed prompt starts with a unique line (see bench_vllm_cpu.py), so nothing is
served from the prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm_cpu import CONFIG, fresh  # noqa: E402
from vllm_smoke import engine_options  # noqa: E402

from agents.llm.base import ActionConstraint, Completion, Request  # noqa: E402
from agents.llm.vllm_backend import VLLMBackend  # noqa: E402

# a thought runs free under the grammar ("think: " then any line), so both cases write tokens
THINKING = ActionConstraint(("go to desk 1", "go to shelf 1"), allow_think=True)


async def sequential(backend: VLLMBackend, requests: list[Request]) -> list[Completion]:
    return [await backend.agenerate(r) for r in requests]


async def concurrent(backend: VLLMBackend, requests: list[Request]) -> list[Completion]:
    return list(await asyncio.gather(*(backend.agenerate(r) for r in requests)))


def timed(run: Any, backend: VLLMBackend, requests: list[Request]) -> tuple[float, int]:
    started = time.perf_counter()
    out = asyncio.run(run(backend, requests))
    return time.perf_counter() - started, sum(c.completion_tokens for c in out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    backend = VLLMBackend(str(args.model), **engine_options(args))
    backend.load_async()
    n = args.requests

    def batch(constraint: ActionConstraint | None = None) -> list[Request]:
        return [Request(config=CONFIG, prompt=fresh(g), constraint=constraint) for g in range(n)]

    timed(concurrent, backend, batch())  # warm-up, not timed
    seq: list[float] = []
    conc: list[float] = []
    free: list[float] = []
    grounded: list[float] = []
    try:
        for _ in range(args.repeats):
            seq.append(timed(sequential, backend, batch())[0])
            conc.append(timed(concurrent, backend, batch())[0])
            t, tokens = timed(concurrent, backend, batch())
            free.append(t / max(tokens, 1))
            t, tokens = timed(concurrent, backend, batch(THINKING))
            grounded.append(t / max(tokens, 1))
    finally:
        backend.close()
    med = statistics.median
    result = {
        "requests": n,
        "repeats": args.repeats,
        "sequential_s": round(med(seq), 3),
        "concurrent_s": round(med(conc), 3),
        "sequential_over_concurrent": round(med(seq) / med(conc), 2),
        "free_s_per_token": round(med(free), 4),
        "grounded_s_per_token": round(med(grounded), 4),
        "grounded_over_free": round(med(grounded) / med(free), 2),
    }
    print(
        f"{n} requests: sequential agenerate {result['sequential_s']} s, concurrent "
        f"{result['concurrent_s']} s, ratio {result['sequential_over_concurrent']}"
    )
    print(
        f"per token: free {result['free_s_per_token']} s, grounded "
        f"{result['grounded_s_per_token']} s, ratio {result['grounded_over_free']}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
