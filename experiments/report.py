"""Reports of finished (or running) runs: summary.json, plots, tables and a static replay page.

Everything here reads the run store; nothing writes to it. Success is cumulative: a task counts as
solved at trial k when it was won in at least one of trials 0..k, and it counts once. Errored
episodes (the harness failed) are counted in ``errors``, never as agent failures.

Layout of the report directory:

- one run: ``summary.json``; several runs: ``summary-<label>.json`` per run and ``comparison.json``
- ``learning_curve.png`` (one line per run), ``failures.png`` (failure classes per trial)
- ``report.md`` (tables) and ``index.html`` (the replay viewer with the data embedded)
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.errors import RunStoreError
from experiments.store import RunStore
from memory.records import EpisodeStatus, FailureClass

# Fixed figure geometry, so the PNGs always have the same pixel size (no tight bbox).
FIG_SIZE_IN = (8.0, 5.0)
FIG_DPI = 100
PNG_SIZE = (int(FIG_SIZE_IN[0] * FIG_DPI), int(FIG_SIZE_IN[1] * FIG_DPI))

# Agent failure classes, in the order plots and tables show them (harness errors are separate).
AGENT_FAILURES = tuple(c.value for c in FailureClass if c is not FailureClass.INFRA_ERROR)
ERROR_BAR = "harness error"

_OUTCOME_COLUMNS = (
    "episode_id, game, task_type, trial, arm, status, won, failure_class, verdict, judge_verdict,"
    " started_at, finished_at"
)


@dataclass(frozen=True)
class Outcome:
    """An episode without its prompt and steps: what reports and the task list need."""

    episode_id: str
    game: str
    task_type: str
    trial: int
    arm: str
    status: str
    won: bool
    failure_class: str | None
    verdict: str | None
    judge_verdict: str | None
    started_at: float
    finished_at: float | None


def episode_outcomes(store: RunStore) -> list[Outcome]:
    """All episodes' outcomes, ordered by trial then game (a light query: no prompts)."""
    rows = store.conn.execute(
        f"SELECT {_OUTCOME_COLUMNS} FROM episodes ORDER BY trial, game"
    ).fetchall()
    return [Outcome(**{**dict(r), "won": bool(r["won"])}) for r in rows]


def open_run(run_dir: Path) -> RunStore:
    """The run's store, read-only; a clear error when it is not a run directory."""
    try:
        return RunStore(run_dir, readonly=True)
    except sqlite3.Error as exc:
        raise RunStoreError(f"cannot read the run store in {str(run_dir)!r}: {exc}") from None


def _task_type_of(game: str) -> str:
    """The short task type from an ALFWorld game id, for tasks that have no episode yet."""
    from envs.discovery import TASK_TYPES, task_type_from_name

    for part in reversed(game.split("/")):
        long = task_type_from_name(part)
        if long is not None:
            return TASK_TYPES[long]
    return "unknown"


def _cost(model: str, tokens: dict[str, int]) -> float:
    try:
        from agents.llm.pricing import cost_usd
    except ImportError:
        return 0.0
    return float(cost_usd(model, tokens["prompt"], tokens["completion"], tokens["cached_prompt"]))


def summarize(store: RunStore) -> dict[str, Any]:
    """The summary of one run (the content of ``summary.json``)."""
    manifest = store.get_meta("manifest") or {}
    config = manifest.get("config") or {}
    outcomes = episode_outcomes(store)
    trial_rows = {t["trial"]: t for t in store.trials()}

    task_types: dict[str, str] = {}
    for game in manifest.get("games") or {}:
        task_types[game] = _task_type_of(game)
    for t in trial_rows.values():
        for game in t["tasks"]:
            task_types.setdefault(game, _task_type_of(game))
    for o in outcomes:
        task_types[o.game] = o.task_type

    arm = str(config.get("agent") or (outcomes[0].arm if outcomes else ""))
    model = str(config.get("model", ""))
    trial_numbers = sorted(set(trial_rows) | {o.trial for o in outcomes})

    solved: set[str] = set()
    trials: list[dict[str, Any]] = []
    for k in trial_numbers:
        in_trial = [o for o in outcomes if o.trial == k]
        ran = trial_rows[k]["tasks"] if k in trial_rows else sorted({o.game for o in in_trial})
        won = {o.game for o in in_trial if o.won}
        new = won - solved
        solved |= won
        failed = [o for o in in_trial if o.status == EpisodeStatus.DONE.value and not o.won]
        trials.append(
            {
                "trial": k,
                "tasks_run": len(ran),
                "newly_solved": len(new),
                "cumulative_solved": len(solved),
                "success_rate": len(solved) / len(task_types) if task_types else 0.0,
                "failed": len(failed),
                "errors": sum(1 for o in in_trial if o.status == EpisodeStatus.ERROR.value),
                "incomplete": sum(
                    1
                    for o in in_trial
                    if o.status in (EpisodeStatus.RUNNING.value, EpisodeStatus.INTERRUPTED.value)
                ),
                "failure_classes": _failure_counts(failed),
            }
        )

    by_type: dict[str, dict[str, int]] = {}
    for game, kind in sorted(task_types.items()):
        entry = by_type.setdefault(kind, {"total": 0, "solved": 0})
        entry["total"] += 1
        entry["solved"] += game in solved

    failed_all = [o for o in outcomes if o.status == EpisodeStatus.DONE.value and not o.won]
    tokens = store.token_totals()
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    events: dict[str, int] = {}
    for e in store.events():
        events[e["kind"]] = events.get(e["kind"], 0) + 1
    return {
        "model": model,
        "arm": arm,
        "evaluator": str(config.get("evaluator", "")),
        "reflect_model": config.get("reflect_model") or model,
        "memory_size": config.get("memory_size"),
        "max_steps": config.get("max_steps"),
        "trials_planned": config.get("trials"),
        "total_tasks": len(task_types),
        "solved": len(solved),
        "success_rate": len(solved) / len(task_types) if task_types else 0.0,
        "trials": trials,
        "by_task_type": by_type,
        "failure_classes": _failure_counts(failed_all),
        "tokens": tokens,
        "cost_usd": _cost(model, tokens),
        "wall_s": _wall_s(store, outcomes),
        "errors": statuses.get(EpisodeStatus.ERROR.value, 0),
        "episodes": statuses,
        "events": events,
        "status": store.get_meta("status"),
        "started_at": manifest.get("started_at"),
    }


def _failure_counts(failed: Sequence[Outcome]) -> dict[str, int]:
    counts = dict.fromkeys(AGENT_FAILURES, 0)
    for o in failed:
        name = o.failure_class or FailureClass.OTHER.value
        counts[name] = counts.get(name, 0) + 1
    return counts


def _wall_s(store: RunStore, outcomes: Sequence[Outcome]) -> float:
    """The runner's recorded wall time; for a run still going, the span of its episodes."""
    recorded = store.get_meta("wall_s")
    if recorded is not None:
        return float(recorded)
    if not outcomes:
        return 0.0
    start = min(o.started_at for o in outcomes)
    end = max(o.finished_at or o.started_at for o in outcomes)
    if any(o.finished_at is None for o in outcomes):
        end = max(end, time.time())
    return max(0.0, end - start)


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """``summarize`` of the run in ``run_dir`` (opened read-only)."""
    store = open_run(run_dir)
    try:
        return summarize(store)
    finally:
        store.close()


# -- comparison ----------------------------------------------------------------------------------
def comparison_row(label: str, run_dir: Path, s: dict[str, Any]) -> dict[str, Any]:
    """One row of the model comparison table."""
    total = s["total_tasks"]
    first = s["trials"][0]["cumulative_solved"] if s["trials"] else 0
    last = s["trials"][-1]["cumulative_solved"] if s["trials"] else 0
    tokens = s["tokens"]["prompt"] + s["tokens"]["completion"]
    return {
        "label": label,
        "run_dir": str(run_dir),
        "model": s["model"],
        "arm": s["arm"],
        "evaluator": s["evaluator"],
        "total_tasks": total,
        "solved_trial0": first,
        "success_trial0": first / total if total else 0.0,
        "last_trial": s["trials"][-1]["trial"] if s["trials"] else None,
        "solved_last": last,
        "success_last": last / total if total else 0.0,
        "tokens": tokens,
        "tokens_per_solved": tokens / last if last else None,
        "cost_usd": s["cost_usd"],
        "cost_per_solved": s["cost_usd"] / last if last else None,
        "wall_s": s["wall_s"],
        "errors": s["errors"],
    }


# -- plots ---------------------------------------------------------------------------------------
def _line_label(s: dict[str, Any], label: str, duplicate: bool) -> str:
    text = f"{s['model']} · {s['arm']}"
    return f"{text} ({label})" if duplicate else text


def plot_learning_curve(
    summaries: Sequence[dict[str, Any]], labels: Sequence[str], path: Path
) -> Path:
    """Cumulative success rate vs trial, one line per run (like the Reflexion paper's figure)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIG_SIZE_IN, dpi=FIG_DPI)
    names = [f"{s['model']} · {s['arm']}" for s in summaries]
    max_trial = 0
    for s, label, name in zip(summaries, labels, names, strict=True):
        xs = [t["trial"] for t in s["trials"]]
        ys = (
            [100.0 * t["cumulative_solved"] / s["total_tasks"] for t in s["trials"]]
            if s["total_tasks"]
            else [0.0 for _ in xs]
        )
        max_trial = max([max_trial, *xs])
        (line,) = ax.plot(xs, ys, marker="o", label=_line_label(s, label, names.count(name) > 1))
        planned = s.get("trials_planned") or 0
        if xs and s["solved"] == s["total_tasks"] > 0 and xs[-1] < planned - 1:
            # every task solved: later trials were not needed, and the rate cannot change
            ax.plot([xs[-1], planned - 1], [ys[-1], ys[-1]], linestyle=":", color=line.get_color())
            xs = [*xs, planned - 1]
    ax.set_xlabel("trial")
    ax.set_ylabel("cumulative success rate (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(-0.3, max_trial + 0.3)
    ax.set_xticks(range(max_trial + 1))
    ax.grid(True, alpha=0.3)
    ax.set_title("Solved in at least one of trials 0..k")
    if summaries:
        ax.legend(loc="lower right")
    return _save(fig, path)


def plot_failures(summaries: Sequence[dict[str, Any]], labels: Sequence[str], path: Path) -> Path:
    """Failure classes per trial as stacked bars (one panel per run); harness errors in grey."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    n = max(len(summaries), 1)
    fig, axes = plt.subplots(1, n, figsize=FIG_SIZE_IN, dpi=FIG_DPI, sharey=True, squeeze=False)
    classes = list(AGENT_FAILURES)
    for s in summaries:
        for t in s["trials"]:
            classes += [c for c in t["failure_classes"] if c not in classes]
    colors = plt.get_cmap("tab10")
    for i, ax in enumerate(axes[0]):
        if i >= len(summaries):
            ax.set_axis_off()
            continue
        s, label = summaries[i], labels[i]
        xs = [t["trial"] for t in s["trials"]]
        bottom = [0.0] * len(xs)
        for j, c in enumerate(classes):
            ys = [float(t["failure_classes"].get(c, 0)) for t in s["trials"]]
            ax.bar(xs, ys, bottom=bottom, label=c, color=colors(j % 10))
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        errs = [float(t["errors"]) for t in s["trials"]]
        ax.bar(xs, errs, bottom=bottom, label=ERROR_BAR, color="#bbbbbb", hatch="//")
        ax.set_title(_line_label(s, label, True) if len(summaries) > 1 else s["arm"], fontsize=9)
        ax.set_xlabel("trial")
        ax.set_xticks(xs)
    axes[0][0].set_ylabel("failed episodes")
    axes[0][0].yaxis.set_major_locator(MaxNLocator(integer=True))
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Why episodes failed, per trial")
    fig.subplots_adjust(bottom=0.24, top=0.88, wspace=0.08)
    return _save(fig, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=FIG_DPI, format="png")
    plt.close(fig)
    return path


# -- tables --------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def trials_table(s: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    header = ["trial", "tasks run", "newly solved", "cumulative solved", "success", "errors"]
    rows = [
        [
            t["trial"],
            t["tasks_run"],
            t["newly_solved"],
            t["cumulative_solved"],
            _pct(t["success_rate"]),
            t["errors"],
        ]
        for t in s["trials"]
    ]
    return header, rows


def task_type_table(s: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    header = ["task type", "tasks", "solved", "success"]
    rows = [
        [kind, v["total"], v["solved"], _pct(v["solved"] / v["total"] if v["total"] else 0.0)]
        for kind, v in sorted(s["by_task_type"].items())
    ]
    return header, rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    header = [
        "run",
        "model",
        "arm",
        "tasks",
        "success trial 0",
        "success last trial",
        "tokens / solved",
        "cost / solved",
        "wall",
        "errors",
    ]
    out = [
        [
            r["label"],
            r["model"],
            r["arm"],
            r["total_tasks"],
            _pct(r["success_trial0"]),
            f"{_pct(r['success_last'])} (trial {r['last_trial']})",
            _num(r["tokens_per_solved"]),
            _num(r["cost_per_solved"], "${:.4f}"),
            f"{r['wall_s']:.0f} s",
            r["errors"],
        ]
        for r in rows
    ]
    return header, out


def markdown_report(
    summaries: Sequence[dict[str, Any]], labels: Sequence[str], comparison: Sequence[dict[str, Any]]
) -> str:
    parts = ["# reflexsim report", ""]
    if len(summaries) > 1:
        parts += ["## Model comparison", "", _md_table(*comparison_table(comparison)), ""]
    for s, label in zip(summaries, labels, strict=True):
        t = s["tokens"]
        parts += [
            f"## {label}: {s['model']} · {s['arm']} · evaluator {s['evaluator']}",
            "",
            f"Solved {s['solved']} of {s['total_tasks']} tasks ({_pct(s['success_rate'])});"
            f" {s['errors']} errored episode(s) (harness, not agent).",
            f"Tokens: {t['prompt']} prompt ({t['cached_prompt']} cached), {t['completion']}"
            f" completion; cost ${s['cost_usd']:.4f}; wall {s['wall_s']:.0f} s.",
            "",
            "### Trials (success is cumulative)",
            "",
            _md_table(*trials_table(s)),
            "",
            "### By task type",
            "",
            _md_table(*task_type_table(s)),
            "",
            "### Failure classes (failed episodes, all trials)",
            "",
            _md_table(["class", "episodes"], sorted(s["failure_classes"].items())),
            "",
        ]
    parts += ["![learning curve](learning_curve.png)", "", "![failures](failures.png)", ""]
    return "\n".join(parts)


# -- the report ----------------------------------------------------------------------------------
def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """A short, file-name-safe, unique label per run (its directory name)."""
    labels: list[str] = []
    for i, d in enumerate(run_dirs):
        base = re.sub(r"[^A-Za-z0-9._+-]+", "_", Path(d).resolve().name).strip("._") or f"run{i}"
        label = base
        n = 2
        while label in labels:
            label = f"{base}-{n}"
            n += 1
        labels.append(label)
    return labels


def write_report(run_dirs: Sequence[Path], out_dir: Path | None = None) -> Path:
    """Write the report of one or more runs; returns the report directory.

    The default directory is ``<first run>/report``.
    """
    from experiments.viewer.static import write_static_page

    if not run_dirs:
        raise RunStoreError("no run directory given: pass at least one run dir")
    dirs = [Path(d) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else dirs[0] / "report"
    labels = run_labels(dirs)
    summaries = [summarize_run(d) for d in dirs]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunStoreError(f"cannot create report dir {str(out)!r}: {exc.strerror}") from None

    comparison = [
        comparison_row(lb, d, s) for lb, d, s in zip(labels, dirs, summaries, strict=True)
    ]
    if len(dirs) == 1:
        _write_json(out / "summary.json", summaries[0])
    else:
        for label, s in zip(labels, summaries, strict=True):
            _write_json(out / f"summary-{label}.json", s)
        _write_json(out / "comparison.json", {"runs": comparison})
    plot_learning_curve(summaries, labels, out / "learning_curve.png")
    plot_failures(summaries, labels, out / "failures.png")
    (out / "report.md").write_text(markdown_report(summaries, labels, comparison))
    write_static_page(
        dirs,
        labels,
        out / "index.html",
        summaries=summaries,
        plots={"learning_curve": out / "learning_curve.png", "failures": out / "failures.png"},
        comparison=comparison if len(dirs) > 1 else None,
    )
    return out


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
