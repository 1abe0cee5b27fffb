"""Pricing: usage to dollars from the shipped table, dated variants, overrides, local = 0."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agents.llm import SpecError
from agents.llm.pricing import Price, cost_usd, load_prices, price_for


def test_shipped_table_loads_and_prices_a_known_model() -> None:
    table = load_prices()
    assert table["openai:gpt-4o-mini"] == Price(input=0.15, output=0.6, cached_input=0.075)
    # 1M fresh input + 1M output
    assert cost_usd("openai:gpt-4o-mini", 1_000_000, 1_000_000, 0) == pytest.approx(0.75)


def test_cached_tokens_are_part_of_prompt_tokens() -> None:
    # 1000 prompt tokens of which 600 cached, 100 output
    expected = (400 * 2.5 + 600 * 1.25 + 100 * 10.0) / 1e6
    assert cost_usd("openai:gpt-4o", 1000, 100, 600) == pytest.approx(expected)


def test_dated_variants_use_the_longest_matching_key() -> None:
    assert price_for("openai:gpt-4o-2024-08-06") == price_for("openai:gpt-4o")
    assert price_for("openai:gpt-4o-mini-2024-07-18") == price_for("openai:gpt-4o-mini")
    assert price_for("anthropic:claude-opus-4-1-20250805") == price_for("anthropic:claude-opus-4-1")
    assert price_for("openai:gpt-4oops") is None


@pytest.mark.parametrize(
    "spec",
    [
        "embedded",
        "embedded:smollm2-135m",
        "vllm:Qwen/X",
        "hf:gpt2",
        "llamacpp:m.gguf",
        "scripted:expert",
    ],
)
def test_local_models_cost_nothing(spec: str) -> None:
    assert cost_usd(spec, 10**6, 10**6, 0) == 0.0


def test_unknown_hosted_model_is_free_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agents.llm.pricing"):
        assert cost_usd("openai:my-finetune-xyz", 1000, 10) == 0.0
        assert cost_usd("openai:my-finetune-xyz", 1000, 10) == 0.0
    warnings = [r for r in caplog.records if "my-finetune-xyz" in r.message]
    assert len(warnings) == 1 and "prices.json" in warnings[0].message


def test_a_user_table_overrides_the_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {"openai:local-qwen": {"input": 1.0, "output": 2.0}}}))
    assert cost_usd("openai:local-qwen", 10**6, 10**6, 5 * 10**5, prices=path) == pytest.approx(3.0)
    monkeypatch.setenv("REFLEXSIM_PRICES", str(path))
    assert price_for("openai:local-qwen") == Price(1.0, 2.0, 1.0)
    assert price_for("openai:gpt-4o") is None  # the override replaces the table


def test_a_broken_table_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"models": {"openai:x": {"input": "cheap"}}}))
    with pytest.raises(SpecError, match="'openai:x' needs numeric 'input' and 'output'"):
        load_prices(path)
    with pytest.raises(SpecError, match="cannot read it"):
        load_prices(tmp_path / "missing.json")
