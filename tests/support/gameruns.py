"""Run configs for end-to-end tests on the generated games (one agent arm each)."""

from __future__ import annotations

from pathlib import Path

from experiments.config import RunConfig

SPLIT = "eval_out_of_distribution"


def game_run(data: Path, tmp: Path, name: str, agent: str, **kw: object) -> RunConfig:
    """One trial of ``agent`` on the games in ``data``, written to ``tmp/name``."""
    base: dict[str, object] = dict(
        data=str(data), split=SPLIT, trials=1, workers=2, concurrency=3,
        run_dir=str(tmp / name), agent=agent,
    )  # fmt: skip
    base.update(kw)
    return RunConfig.of(**base)
