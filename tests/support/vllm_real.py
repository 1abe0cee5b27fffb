"""The real vLLM CPU build in the slow tests: the python that has it, the engine settings the
tests start it with, and what two test modules check alike.

The real engine needs a python with vllm (``scripts/setup_vllm_cpu.sh`` makes ``.venv-vllm``);
point ``REFLEXSIM_VLLM_PYTHON`` at it. The tests that need it are skipped otherwise.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from experiments.report import RunSummary
from tests.support.backend_process import converted_checkpoint

VLLM_PYTHON = os.environ.get("REFLEXSIM_VLLM_PYTHON")

# float32: greedy repeats are bit-for-bit even when a prompt comes partly from the prefix cache;
# on the CPU build gpu_memory_utilization is a share of host RAM: ask for a fixed cache instead
ENGINE = {"dtype": "float32", "enforce_eager": "true", "max_model_len": "4096",
          "kv_cache_memory_bytes": str(512 << 20)}  # fmt: skip

# an actor instruction of about 5000 tokens: no prompt that carries it fits a 4096-token context
LONG_INSTRUCTION = "Interact with the household and finish the task it names in few steps. " * 400


def context_limited(episodes: list[Any], summary: RunSummary, limit: int) -> list[tuple[int, int]]:
    """Every episode ended, once, at the model's context ``limit`` (done, class
    ``context_limit``; the report counts them): the (prompt tokens, limit) of each verdict."""
    assert episodes and all(e.status == "done" and e.attempts == 1 for e in episodes)
    assert all(e.failure_class == "context_limit" for e in episodes)
    assert summary.failure_classes["context_limit"] == len(episodes)
    assert summary.errors == 0
    counts: list[tuple[int, int]] = []
    for e in episodes:
        numbers = [int(n) for n in re.findall(r"\d+", e.verdict or "")]
        assert len(numbers) == 2 and numbers[0] > 0 and numbers[1] == limit, e.verdict
        counts.append((numbers[0], numbers[1]))
    return counts


def checkpoint() -> str:
    """The embedded Gemma as a checkpoint vLLM loads (converted once); the calling test is
    skipped without ``REFLEXSIM_VLLM_PYTHON``."""
    if not VLLM_PYTHON:
        pytest.skip("set REFLEXSIM_VLLM_PYTHON to a python with vllm")
    return converted_checkpoint(VLLM_PYTHON)
