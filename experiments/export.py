"""Export a run's episodes and steps as JSONL or CSV files that pandas reads."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError, is_disk_full
from experiments.store import open_reader
from memory.files import atomic_write


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Enum members as their values, so JSON and CSV carry plain strings."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in row.items()}


def export(run_dir: Path, fmt: str, out_dir: Path | None = None) -> list[Path]:
    """Write ``episodes.<fmt>`` and ``steps.<fmt>``; returns their paths."""
    if fmt not in ("jsonl", "csv"):
        raise ValueError(f"unknown export format {fmt!r}: use jsonl or csv")
    with open_reader(run_dir) as reader:
        out = out_dir or run_dir / "export"
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unwritable(out, exc) from None
        episodes = []
        steps = []
        all_steps = reader.all_steps()
        for e in reader.episodes():
            row = _plain(dataclasses.asdict(e))
            row.pop("prompt_prefix")  # large and identical across a task's episodes
            episodes.append(row)
            for s in all_steps.get(e.episode_id, []):
                steps.append(
                    {"episode_id": e.episode_id, "game": e.game, "trial": e.trial}
                    | _plain(s.to_dict())
                )
    paths = [out / f"episodes.{fmt}", out / f"steps.{fmt}"]
    try:
        for path, rows in zip(paths, (episodes, steps), strict=True):
            _write(path, fmt, rows)
    except OSError as exc:
        raise unwritable(out, exc) from None
    return paths


def unwritable(out: Path, exc: OSError) -> Exception:
    if is_disk_full(exc):
        return exc  # the CLI's one line for a full disk: free space, then run it again
    return ConfigError(
        f"cannot write the export to {str(out)!r} ({exc.strerror or exc}): "
        "pass a writable folder as --out"
    )


def _write(path: Path, fmt: str, rows: list[dict[str, Any]]) -> None:
    """All rows or nothing (see :mod:`memory.files`)."""
    if fmt == "jsonl":
        write_jsonl(path, rows)
        return
    with atomic_write(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object a line, all rows or nothing."""
    with atomic_write(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
