"""Token usage to US dollars, from a user-editable price table.

The table is ``agents/llm/prices.json`` (package data): USD per 1M tokens of ``input``
(uncached prompt), ``output`` and ``cached_input``, keyed by model spec. A key matches the spec
itself and its dated or suffixed variants (``openai:gpt-4o`` prices ``openai:gpt-4o-2024-08-06``;
the longest matching key wins). Another table of the same shape can be passed as ``prices=`` (a
path or a loaded mapping) or named by the ``REFLEXSIM_PRICES`` environment variable.

``prompt_tokens`` includes ``cached_tokens`` (the OpenAI convention, which every backend here
follows), so cost = (prompt - cached) * input + cached * cached_input + completion * output.
Local backends cost 0. A hosted model missing from the table costs 0 and is logged once as a
warning, naming the table to edit.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from agents.llm.base import SpecError

log = logging.getLogger("agents.llm.pricing")

LOCAL_PREFIXES = frozenset({"vllm", "hf", "llamacpp", "embedded", "scripted"})
_warned: set[str] = set()


@dataclass(frozen=True)
class Price:
    """USD per 1M tokens."""

    input: float
    output: float
    cached_input: float


PriceTable = Mapping[str, Price]


def _parse(data: object, where: str) -> dict[str, Price]:
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise SpecError(f"price table {where}: expected an object with a 'models' object")
    table = {}
    for spec, entry in data["models"].items():
        try:
            table[spec] = Price(
                input=float(entry["input"]),
                output=float(entry["output"]),
                cached_input=float(entry.get("cached_input", entry["input"])),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise SpecError(
                f"price table {where}: {spec!r} needs numeric 'input' and 'output' "
                "(and optionally 'cached_input'), USD per 1M tokens"
            ) from None
    return table


@lru_cache(maxsize=8)
def _load_cached(path: str | None) -> dict[str, Price]:
    if path is None:
        text = resources.files("agents.llm").joinpath("prices.json").read_text(encoding="utf-8")
        where = "agents/llm/prices.json"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError(f"price table {path}: cannot read it ({exc.strerror})") from None
        where = path
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"price table {where}: not valid JSON ({exc})") from None
    return _parse(data, where)


def load_prices(path: str | Path | None = None) -> dict[str, Price]:
    """The price table at ``path``, else ``$REFLEXSIM_PRICES``, else the shipped one."""
    if path is None:
        path = os.environ.get("REFLEXSIM_PRICES") or None
    return dict(_load_cached(None if path is None else str(path)))


def price_for(model_spec: str, prices: PriceTable | str | Path | None = None) -> Price | None:
    """The price of a hosted model, or None (local models and unknown ones)."""
    table = prices if isinstance(prices, Mapping) else load_prices(prices)
    spec = model_spec.strip()
    if spec in table:
        return table[spec]
    best = None
    for key in table:
        if (
            spec.startswith(key)
            and spec[len(key)] in "-@:."
            and (best is None or len(key) > len(best))
        ):
            best = key
    return table[best] if best is not None else None


def is_local(model_spec: str) -> bool:
    return model_spec.strip().partition(":")[0].lower() in LOCAL_PREFIXES


def cost_usd(
    model_spec: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    *,
    prices: PriceTable | str | Path | None = None,
) -> float:
    """Dollars for this usage; 0 for local models and (with a warning) unpriced ones."""
    if is_local(model_spec):
        return 0.0
    if min(prompt_tokens, completion_tokens, cached_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    price = price_for(model_spec, prices)
    if price is None:
        if model_spec not in _warned:
            _warned.add(model_spec)
            log.warning(
                "no price for %s: counted as $0; add it to agents/llm/prices.json "
                "or a table named by REFLEXSIM_PRICES",
                model_spec,
            )
        return 0.0
    cached = min(cached_tokens, prompt_tokens)
    return (
        (prompt_tokens - cached) * price.input
        + cached * price.cached_input
        + completion_tokens * price.output
    ) / 1_000_000
