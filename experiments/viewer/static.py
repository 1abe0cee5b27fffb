"""The static report page: the replay viewer with every run's data embedded (works from file://)."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.store import open_reader
from experiments.viewer.data import episode_detail, run_index
from experiments.viewer.page import static_page
from memory.files import write_text

if TYPE_CHECKING:  # types only: the report imports this module
    from experiments.report import RunSummary


def static_bundle(
    run_dirs: Sequence[Path], labels: Sequence[str], summaries: Sequence[RunSummary]
) -> dict[str, Any]:
    """All runs (with their report summaries), all episodes and steps; each distinct prompt
    prefix stored once."""
    prefixes: list[str] = []
    prefix_ids: dict[str, int] = {}
    runs: list[dict[str, Any]] = []
    details: dict[str, dict[str, Any]] = {}
    for i, (run_dir, label, summary) in enumerate(zip(run_dirs, labels, summaries, strict=True)):
        with open_reader(Path(run_dir)) as reader:
            runs.append(run_index(reader, i, label, summary))
            steps = reader.all_steps()
            per_run: dict[str, Any] = {}
            for row in reader.episodes():
                detail = episode_detail(reader, row, steps.get(row.episode_id, []))
                ref = prefix_ids.setdefault(row.prompt_prefix, len(prefixes))
                if ref == len(prefixes):
                    prefixes.append(row.prompt_prefix)
                detail["prefix_ref"] = ref
                per_run[row.episode_id] = detail
            details[str(i)] = per_run
    return {"mode": "static", "runs": runs, "details": details, "prefixes": prefixes}


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def write_static_page(
    run_dirs: Sequence[Path],
    labels: Sequence[str],
    path: Path,
    *,
    summaries: Sequence[RunSummary],
    plots: Mapping[str, Path] | None = None,
    comparison: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Write ``index.html`` for the runs (``summaries``: each run's report summary); plots are
    embedded as data: images."""
    data = static_bundle(run_dirs, labels, summaries)
    data["plots"] = {name: _data_uri(p) for name, p in (plots or {}).items() if p.is_file()}
    data["comparison"] = list(comparison) if comparison else None
    title = "reflexsim report: " + ", ".join(labels)
    write_text(path, static_page(title, data))
    return path
