"""Measure what llama.cpp's grammar sampler costs per generated token (grounded vs free).

    python scripts/bench_grounding_llamacpp.py [--model embedded|embedded:smollm2-135m]

The same cached prompt is answered free and under a thought-only ActionConstraint (the grammar
stays open for the whole answer, so both write the same number of tokens), alternately, and the
medians of ``--repeats`` seconds per completion token are compared. Measured side by side in one
run: compare the ratio (the machine may be shared and noisy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from agents.llm import GenerationConfig, Request, make_backend
from agents.llm.base import ActionConstraint

PROMPT = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a "
    "countertop 1, a drawer 1.\nYour task is to: put a clean mug in cabinet.\n> think: To solve "
    "the task, I need to find a mug, clean it, then put it in the cabinet.\nOK.\n>"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backend = make_backend(args.model, n_ctx=2048, slots=1)
    config = GenerationConfig(max_tokens=24, stop=())
    thinking = ActionConstraint((), allow_think=True)
    backend.generate([Request(config=config, prompt=PROMPT)])  # warm-up: the prompt is cached
    per_token: dict[str, list[float]] = {"free": [], "grounded": []}
    for _ in range(args.repeats):
        for case, constraint in (("free", None), ("grounded", thinking)):
            started = time.perf_counter()
            (out,) = backend.generate(
                [Request(config=config, prompt=PROMPT, constraint=constraint)]
            )
            per_token[case].append((time.perf_counter() - started) / max(out.completion_tokens, 1))
    backend.close()
    free, grounded = (statistics.median(per_token[k]) for k in ("free", "grounded"))
    print(
        f"{args.model}: s/token free {free:.4f}, grounded {grounded:.4f}, "
        f"ratio {grounded / free:.2f} (median of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
