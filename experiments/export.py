"""Export a run's episodes and steps as JSONL or CSV files that pandas reads."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from experiments.store import RunStore


def export(run_dir: Path, fmt: str, out_dir: Path | None = None) -> list[Path]:
    """Write ``episodes.<fmt>`` and ``steps.<fmt>``; returns their paths."""
    if fmt not in ("jsonl", "csv"):
        raise ValueError(f"unknown export format {fmt!r}: use jsonl or csv")
    store = RunStore(run_dir, readonly=True)
    out = out_dir or run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    try:
        episodes = []
        steps = []
        for e in store.episodes():
            row = dataclasses.asdict(e)
            row.pop("prompt_prefix")  # large and identical across a task's episodes
            episodes.append(row)
            for s in store.steps(e.episode_id):
                steps.append(
                    {"episode_id": e.episode_id, "game": e.game, "trial": e.trial, **s.to_dict()}
                )
    finally:
        store.close()
    paths = [out / f"episodes.{fmt}", out / f"steps.{fmt}"]
    for path, rows in zip(paths, (episodes, steps), strict=True):
        if fmt == "jsonl":
            with path.open("w") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        else:
            fields = list(rows[0]) if rows else []
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
    return paths
