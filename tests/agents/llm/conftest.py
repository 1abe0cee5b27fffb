"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest

from tests.support.vllm_real import checkpoint


@pytest.fixture(scope="session")
def vllm_checkpoint() -> str:
    """The embedded Gemma converted for vLLM (skips without ``REFLEXSIM_VLLM_PYTHON``)."""
    return checkpoint()
