"""Reports of finished (or running) runs: summary.json, plots, tables and a static replay page.

Everything here reads the run store; nothing writes to it. Success is cumulative: a task counts as
solved at trial k when it was won in at least one of trials 0..k, and it counts once. Errored
episodes (the harness failed) are counted in ``errors``, never as agent failures.

Uncertainty: every success rate carries a 95% Wilson interval (``success_ci``); two runs over the
same tasks get a paired table (both / only A / only B / neither) and McNemar's exact test. The
statistics come from scipy.

Layout of the report directory:

- one run: ``summary.json``; several runs: ``summary-<label>.json`` per run and ``comparison.json``
  (``runs``: one row per run; ``paired``: the paired tables)
- ``learning_curve.png`` (one line and interval band per run), ``failures.png`` (failure classes per trial)
- ``compute.png``: success against env steps (replays included) and against tokens, one line per
  run, a point per trial: arms are compared at equal compute, so a search that spends more per
  episode is not credited for it
- ``report.md`` (tables) and ``index.html`` (the replay viewer with the data embedded)

Escalation runs (unsolved tasks re-run once with another model) are shown apart: they are not
part of the trials, the curves or the compute.
"""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from agents import arms
from experiments.errors import RunStoreError
from experiments.store import (
    CallTotals,
    EpisodeError,
    Outcome,
    RunReader,
    RunState,
    Tokens,
    open_reader,
)
from experiments.terminal import escape_controls
from memory.files import atomic_write, write_text
from memory.records import EndClass, EpisodeStatus, classify_end

# Fixed figure geometry, so the PNGs always have the same pixel size (no tight bbox).
FIG_SIZE_IN = (8.0, 5.0)
FIG_DPI = 100
PNG_SIZE = (int(FIG_SIZE_IN[0] * FIG_DPI), int(FIG_SIZE_IN[1] * FIG_DPI))

ERROR_BAR = "harness error"

CONFIDENCE = 0.95  # of every interval in the report
BAND_ALPHA = 0.15  # opacity of the interval bands on the learning curve


# -- statistics (scipy) --------------------------------------------------------------------------
def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a success rate; (0, 1) when there are no trials."""
    if n == 0:
        return (0.0, 1.0)
    from scipy.stats import binomtest  # heavy: scipy, only for a report's tests

    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact test (two-sided): the binomial test of the discordant pairs at 1/2."""
    if only_a + only_b == 0:
        return 1.0
    from scipy.stats import binomtest  # heavy: scipy, only for a report's tests

    return float(binomtest(only_a, only_a + only_b, 0.5, alternative="two-sided").pvalue)


def _task_type_of(game: str) -> str:
    """The short task type from an ALFWorld game id, for tasks that have no episode yet."""
    # lazily: envs loads gymnasium and numpy
    from envs.discovery import TASK_TYPES, task_type_from_name

    for part in reversed(game.split("/")):
        long = task_type_from_name(part)
        if long is not None:
            return TASK_TYPES[long]
    return "unknown"


@dataclass(frozen=True)
class TrialSummary:
    """One trial: what it ran, what it solved (cumulatively), why its episodes failed."""

    trial: int
    tasks_run: int
    newly_solved: int
    cumulative_solved: int
    success_rate: float
    success_ci: tuple[float, float]
    failed: int
    errors: int
    incomplete: int
    failure_classes: dict[str, int]


@dataclass(frozen=True)
class TaskTypeCount:
    total: int = 0
    solved: int = 0


@dataclass(frozen=True)
class ComputePoint:
    """What the trials up to ``trial`` spent, and the success they reached."""

    trial: int
    env_steps: int
    tokens: int
    cumulative_solved: int
    success_rate: float


@dataclass(frozen=True)
class Compute:
    """What the trials spent, cumulatively (see :func:`compute_curve`)."""

    env_steps: int
    tokens: int
    replay_steps_included: bool
    by_trial: tuple[ComputePoint, ...]
    total_tasks: int


@dataclass(frozen=True)
class EscalationSummary:
    """Escalation runs: how many unsolved tasks were re-run with which model, and solved."""

    models: tuple[str, ...]
    tasks: int
    solved: int
    games: dict[str, bool]


@dataclass(frozen=True)
class RunSummary:
    """The summary of one run; :meth:`to_dict` is the content of ``summary.json``."""

    model: str
    arm: str
    evaluator: str
    reflect_model: Any
    memory_size: Any
    max_steps: Any
    trials_planned: Any
    total_tasks: int
    solved: int
    success_rate: float
    success_ci: tuple[float, float]
    solved_at_trial: dict[str, int | None]
    trials: tuple[TrialSummary, ...]
    by_task_type: dict[str, TaskTypeCount]  # solved: by the last trial
    first_by_task_type: dict[str, int]  # of them, solved at trial 0
    failure_classes: dict[str, int]
    tokens: Tokens
    tokens_by_purpose: dict[str, CallTotals]
    cost_usd: float
    wall_s: float
    errors: int
    episodes: dict[str, int]
    events: dict[str, int]
    attempt_errors: tuple[EpisodeError, ...]  # every attempt's harness error, retried ones too
    status: RunState
    started_at: Any
    compute: Compute
    escalation: EscalationSummary | None
    experience: dict[str, Any] | None = None  # the gathering run it was shown (run, split, digest)

    def to_dict(self) -> dict[str, Any]:
        errors = [
            {"episode": e.episode_id, "attempt": e.attempt, "kind": e.kind, "error": e.error}
            for e in self.attempt_errors
        ]
        return {**asdict(self), "status": self.status.to_dict(), "attempt_errors": errors}


def summarize(reader: RunReader) -> RunSummary:
    """The summary of one run."""
    manifest = reader.get_meta("manifest") or {}
    config = manifest.get("config") or {}
    outcomes = reader.outcomes()
    trial_rows = {t.trial: t for t in reader.trial_rows()}

    task_types: dict[str, str] = {}
    for game in manifest.get("games") or {}:
        task_types[game] = _task_type_of(game)
    for t in trial_rows.values():
        for game in t.tasks:
            task_types.setdefault(game, _task_type_of(game))
    for o in outcomes:
        task_types[o.game] = o.task_type
    total = len(task_types)

    arm = str(config.get("agent") or (outcomes[0].arm if outcomes else ""))
    ends = arms.ends(arm)
    model = str(config.get("model", ""))
    trial_numbers = sorted(set(trial_rows) | {o.trial for o in outcomes})

    solved_at: dict[str, int | None] = dict.fromkeys(sorted(task_types))
    trials: list[TrialSummary] = []
    for k in trial_numbers:
        in_trial = [o for o in outcomes if o.trial == k]
        ran = trial_rows[k].tasks if k in trial_rows else sorted({o.game for o in in_trial})
        won = {o.game for o in in_trial if o.won}
        new = {g for g in won if solved_at[g] is None}
        for game in new:
            solved_at[game] = k
        cumulative = sum(v is not None for v in solved_at.values())
        failed = [o for o in in_trial if o.status is EpisodeStatus.DONE and not o.won]
        trials.append(
            TrialSummary(
                trial=k,
                tasks_run=len(ran),
                newly_solved=len(new),
                cumulative_solved=cumulative,
                success_rate=cumulative / total if total else 0.0,
                success_ci=wilson_interval(cumulative, total),
                failed=len(failed),
                errors=sum(1 for o in in_trial if o.status is EpisodeStatus.ERROR),
                incomplete=sum(
                    1
                    for o in in_trial
                    if o.status in (EpisodeStatus.RUNNING, EpisodeStatus.INTERRUPTED)
                ),
                failure_classes=_failure_counts(failed, ends),
            )
        )
    solved = sum(v is not None for v in solved_at.values())

    by_type: dict[str, TaskTypeCount] = {}
    for game, kind in sorted(task_types.items()):
        entry = by_type.get(kind, TaskTypeCount())
        by_type[kind] = TaskTypeCount(entry.total + 1, entry.solved + (solved_at[game] is not None))
    first_by_type = {kind: 0 for kind in by_type}
    for game, kind in task_types.items():
        first_by_type[kind] += solved_at[game] == 0

    failed_all = [o for o in outcomes if o.status is EpisodeStatus.DONE and not o.won]
    tokens = reader.token_totals()
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status.value] = statuses.get(o.status.value, 0) + 1
    return RunSummary(
        model=model,
        arm=arm,
        evaluator=str(config.get("evaluator", "")),
        reflect_model=config.get("reflect_model") or model,
        memory_size=config.get("memory_size"),
        max_steps=config.get("max_steps"),
        trials_planned=config.get("trials"),
        total_tasks=total,
        solved=solved,
        success_rate=solved / total if total else 0.0,
        success_ci=wilson_interval(solved, total),
        solved_at_trial=solved_at,
        trials=tuple(trials),
        by_task_type=by_type,
        first_by_task_type=first_by_type,
        failure_classes=_failure_counts(failed_all, ends),
        tokens=tokens,
        tokens_by_purpose=reader.calls_by_purpose(),
        cost_usd=tokens.cost_usd(model),
        wall_s=_wall_s(reader, outcomes),
        errors=statuses.get(EpisodeStatus.ERROR.value, 0),
        episodes=statuses,
        events=reader.event_counts(),
        attempt_errors=tuple(reader.episode_errors()),
        status=reader.run_state(),
        started_at=manifest.get("started_at"),
        compute=compute_curve(reader, outcomes, trials, total),
        escalation=_escalation(reader, set(solved_at)),
        experience=manifest.get("experience"),
    )


def compute_curve(
    reader: RunReader, outcomes: Sequence[Outcome], trials: Sequence[TrialSummary], total: int
) -> Compute:
    """What the trials spent, cumulatively: env steps (a search's replays included) and tokens
    (every call of the trial: acting, planning, values, reflections), with the success rate."""
    env = reader.env_steps()
    tokens = reader.tokens_by_trial()
    steps_by_trial: dict[int, int] = {}
    for o in outcomes:
        steps_by_trial[o.trial] = steps_by_trial.get(o.trial, 0) + env.get(o.episode_id, 0)
    points, cum_steps, cum_tokens = [], 0, 0
    for t in trials:
        cum_steps += steps_by_trial.get(t.trial, 0)
        cum_tokens += tokens.get(t.trial, 0)
        points.append(
            ComputePoint(t.trial, cum_steps, cum_tokens, t.cumulative_solved, t.success_rate)
        )
    searched = reader.searched_episodes()
    return Compute(
        env_steps=cum_steps,
        tokens=cum_tokens,
        replay_steps_included=bool(searched & {o.episode_id for o in outcomes}),
        by_trial=tuple(points),
        total_tasks=total,
    )


def _escalation(reader: RunReader, tasks: set[str]) -> EscalationSummary | None:
    """Escalation runs: how many unsolved tasks were re-run with which model, and solved."""
    runs = [e for e in reader.escalations() if e.outcome.game in tasks]
    if not runs:
        return None
    return EscalationSummary(
        models=tuple(sorted({e.model for e in runs})),
        tasks=len(runs),
        solved=sum(e.outcome.won for e in runs),
        games={e.outcome.game: e.outcome.won for e in runs},
    )


def _failure_counts(failed: Sequence[Outcome], ends: tuple[EndClass, ...]) -> dict[str, int]:
    """Failed episodes by class: every class the arm declares (zero or more), and any other
    class recorded (the oscillation stop); an end recorded as ``other`` whose verdict names
    one of the arm's ends is counted as that end."""
    counts = {e.failure_class.value: 0 for e in ends}
    for o in failed:
        name = classify_end(o.failure_class, o.verdict, ends).value
        counts[name] = counts.get(name, 0) + 1
    return counts


def _wall_s(reader: RunReader, outcomes: Sequence[Outcome]) -> float:
    """The runner's recorded wall time; for a run still going, the span of its episodes."""
    recorded = reader.get_meta("wall_s")
    if recorded is not None:
        return float(recorded)
    if not outcomes:
        return 0.0
    start = min(o.started_at for o in outcomes)
    end = max(o.finished_at or o.started_at for o in outcomes)
    if any(o.finished_at is None for o in outcomes):
        end = max(end, time.time())
    return max(0.0, end - start)


def summarize_run(run_dir: Path) -> RunSummary:
    """``summarize`` of the run in ``run_dir`` (opened read-only)."""
    with open_reader(run_dir) as reader:
        return summarize(reader)


# -- comparison ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComparisonRow:
    """One run in the model comparison (a row of ``comparison.json``'s ``runs``)."""

    label: str
    run_dir: str
    model: str
    arm: str
    evaluator: str
    total_tasks: int
    solved_trial0: int
    success_trial0: float
    success_trial0_ci: tuple[float, float]
    last_trial: int | None
    solved_last: int
    success_last: float
    success_last_ci: tuple[float, float]
    tokens: int
    tokens_per_solved: float | None
    env_steps: int
    env_steps_per_solved: float | None
    cost_usd: float
    cost_per_solved: float | None
    wall_s: float
    errors: int


@dataclass(frozen=True)
class PairedTable:
    """Two runs over the same tasks at ``trial``: tasks solved by both, one or neither."""

    a: str
    b: str
    trial: int
    tasks: int
    both: int
    only_a: int
    only_b: int
    neither: int
    p_value: float


def comparison_row(label: str, run_dir: Path, s: RunSummary) -> ComparisonRow:
    """One row of the model comparison table."""
    total = s.total_tasks
    first = s.trials[0].cumulative_solved if s.trials else 0
    last = s.trials[-1].cumulative_solved if s.trials else 0
    tokens = s.tokens.total
    return ComparisonRow(
        label=label,
        run_dir=str(run_dir),
        model=s.model,
        arm=s.arm,
        evaluator=s.evaluator,
        total_tasks=total,
        solved_trial0=first,
        success_trial0=first / total if total else 0.0,
        success_trial0_ci=wilson_interval(first, total),
        last_trial=s.trials[-1].trial if s.trials else None,
        solved_last=last,
        success_last=last / total if total else 0.0,
        success_last_ci=wilson_interval(last, total),
        tokens=tokens,
        tokens_per_solved=tokens / last if last else None,
        env_steps=s.compute.env_steps,
        env_steps_per_solved=s.compute.env_steps / last if last else None,
        cost_usd=s.cost_usd,
        cost_per_solved=s.cost_usd / last if last else None,
        wall_s=s.wall_s,
        errors=s.errors,
    )


def _known_until(s: RunSummary) -> float:
    """The last trial whose cumulative success is known: the last played, or forever once every
    task is solved (later trials could not change it)."""
    if s.total_tasks and s.solved == s.total_tasks:
        return float("inf")
    return float(s.trials[-1].trial) if s.trials else -1.0


def paired_table(a: RunSummary, b: RunSummary, trial: int, labels: tuple[str, str]) -> PairedTable:
    """Two runs over the same tasks at ``trial``: each task solved by then in both, only one or
    neither, and McNemar's exact p-value for the difference."""
    both = only_a = only_b = neither = 0
    for game, at_a in a.solved_at_trial.items():
        at_b = b.solved_at_trial[game]
        in_a = at_a is not None and at_a <= trial
        in_b = at_b is not None and at_b <= trial
        both += in_a and in_b
        only_a += in_a and not in_b
        only_b += in_b and not in_a
        neither += not (in_a or in_b)
    return PairedTable(
        a=labels[0],
        b=labels[1],
        trial=trial,
        tasks=both + only_a + only_b + neither,
        both=both,
        only_a=only_a,
        only_b=only_b,
        neither=neither,
        p_value=mcnemar_exact(only_a, only_b),
    )


def paired_comparisons(summaries: Sequence[RunSummary], labels: Sequence[str]) -> list[PairedTable]:
    """Every pair of runs over the same tasks, at trial 0 and at the last trial both have."""
    out = []
    for i, j in combinations(range(len(summaries)), 2):
        a, b = summaries[i], summaries[j]
        if not a.solved_at_trial or set(a.solved_at_trial) != set(b.solved_at_trial):
            continue
        until = min(_known_until(a), _known_until(b))
        if until < 0:
            continue
        if until == float("inf"):
            until = max(a.trials[-1].trial, b.trials[-1].trial)
        for trial in sorted({0, int(until)}):
            out.append(paired_table(a, b, trial, (labels[i], labels[j])))
    return out


# -- plots ---------------------------------------------------------------------------------------
def _line_label(s: RunSummary, label: str, duplicate: bool) -> str:
    text = f"{s.model} · {s.arm}"
    return f"{text} ({label})" if duplicate else text


def plot_learning_curve(
    summaries: Sequence[RunSummary],
    labels: Sequence[str],
    path: Path,
    paired: Sequence[PairedTable] = (),
) -> Path:
    """Cumulative success rate vs trial, one line per run (like the Reflexion paper's figure),
    each with its Wilson interval as a band; for two runs, the paired test's p-values."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIG_SIZE_IN, dpi=FIG_DPI)
    names = [f"{s.model} · {s.arm}" for s in summaries]
    max_trial = 0
    for s, label, name in zip(summaries, labels, names, strict=True):
        xs = [t.trial for t in s.trials]
        ys = (
            [100.0 * t.cumulative_solved / s.total_tasks for t in s.trials]
            if s.total_tasks
            else [0.0 for _ in xs]
        )
        max_trial = max([max_trial, *xs])
        (line,) = ax.plot(xs, ys, marker="o", label=_line_label(s, label, names.count(name) > 1))
        if s.total_tasks:
            lows = [100.0 * t.success_ci[0] for t in s.trials]
            highs = [100.0 * t.success_ci[1] for t in s.trials]
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=BAND_ALPHA, lw=0)
        planned = s.trials_planned or 0
        if xs and s.solved == s.total_tasks > 0 and xs[-1] < planned - 1:
            # every task solved: later trials were not needed, and the rate cannot change
            ax.plot([xs[-1], planned - 1], [ys[-1], ys[-1]], linestyle=":", color=line.get_color())
            xs = [*xs, planned - 1]
    ax.set_xlabel("trial")
    ax.set_ylabel("cumulative success rate (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(-0.3, max_trial + 0.3)
    ax.set_xticks(range(max_trial + 1))
    ax.grid(True, alpha=0.3)
    ax.set_title(
        f"Solved in at least one of trials 0..k (bands: {CONFIDENCE:.0%} Wilson intervals)"
    )
    if summaries:
        ax.legend(loc="lower right")
    if len(summaries) == 2 and paired:
        text = ", ".join(f"trial {p.trial}: p = {_p(p.p_value)}" for p in paired)
        ax.text(0.02, 0.97, f"McNemar exact: {text}", transform=ax.transAxes, va="top", fontsize=8)
    return _save(fig, path)


def plot_compute(summaries: Sequence[RunSummary], labels: Sequence[str], path: Path) -> Path:
    """Cumulative success against env steps (replays included) and against tokens: one line
    per run, a point per trial, so arms are compared at equal compute."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=FIG_SIZE_IN, dpi=FIG_DPI, sharey=True)
    names = [f"{s.model} · {s.arm}" for s in summaries]
    for s, label, name in zip(summaries, labels, names, strict=True):
        points = s.compute.by_trial
        ys = [100.0 * p.success_rate for p in points]
        text = _line_label(s, label, names.count(name) > 1)
        axes[0].plot([p.env_steps for p in points], ys, marker="o", label=text)
        axes[1].plot([p.tokens for p in points], ys, marker="o", label=text)
    axes[0].set_xlabel("env steps (replays included)")
    axes[1].set_xlabel("tokens (all calls)")
    axes[0].set_ylabel("cumulative success rate (%)")
    for ax in axes:
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
    if summaries:
        axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle("Success at equal compute (a point per trial)")
    return _save(fig, path)


def plot_failures(summaries: Sequence[RunSummary], labels: Sequence[str], path: Path) -> Path:
    """Failure classes per trial as stacked bars (one panel per run); harness errors in grey."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # heavy: matplotlib, only for a report's figures

    n = max(len(summaries), 1)
    fig, axes = plt.subplots(1, n, figsize=FIG_SIZE_IN, dpi=FIG_DPI, sharey=True, squeeze=False)
    classes: list[str] = []
    for s in summaries:
        for t in s.trials:
            classes += [c for c in t.failure_classes if c not in classes]
    colors = plt.get_cmap("tab10")
    for i, ax in enumerate(axes[0]):
        if i >= len(summaries):
            ax.set_axis_off()
            continue
        s, label = summaries[i], labels[i]
        xs = [t.trial for t in s.trials]
        bottom = [0.0] * len(xs)
        for j, c in enumerate(classes):
            ys = [float(t.failure_classes.get(c, 0)) for t in s.trials]
            ax.bar(xs, ys, bottom=bottom, label=c, color=colors(j % 10))
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        errs = [float(t.errors) for t in s.trials]
        ax.bar(xs, errs, bottom=bottom, label=ERROR_BAR, color="#bbbbbb", hatch="//")
        ax.set_title(_line_label(s, label, True) if len(summaries) > 1 else s.arm, fontsize=9)
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
    import matplotlib  # heavy: matplotlib, only for a report's figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib, only for a report's figures

    return plt


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt  # heavy: matplotlib, only for a report's figures

    with atomic_write(path, "wb") as f:
        fig.savefig(f, dpi=FIG_DPI, format="png")
    plt.close(fig)
    return path


# -- tables --------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _md(v: Any) -> str:
    """A value from a run (a config field, a game id) as inline Markdown text: HTML in it is
    shown, never rendered (report.md may be viewed as HTML), on one line."""
    return html.escape(escape_controls(str(v)), quote=False).replace("\n", " ")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return _md(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _ci(ci: Sequence[float]) -> str:
    return f"{100.0 * ci[0]:.1f}–{100.0 * ci[1]:.1f}%"


def _p(p: float) -> str:
    return f"{p:.3g}" if p >= 0.001 else f"{p:.1e}"


def trials_table(s: RunSummary) -> tuple[list[str], list[list[Any]]]:
    header = ["trial", "tasks run", "newly solved", "cumulative solved", "success", "95% CI"]
    header.append("errors")
    rows = [
        [
            t.trial,
            t.tasks_run,
            t.newly_solved,
            t.cumulative_solved,
            _pct(t.success_rate),
            _ci(t.success_ci),
            t.errors,
        ]
        for t in s.trials
    ]
    return header, rows


def task_type_table(s: RunSummary) -> tuple[list[str], list[list[Any]]]:
    header = ["task type", "tasks", "solved", "success"]
    rows = [
        [kind, v.total, v.solved, _pct(v.solved / v.total if v.total else 0.0)]
        for kind, v in sorted(s.by_task_type.items())
    ]
    return header, rows


def experience_table(
    summaries: Sequence[RunSummary], labels: Sequence[str]
) -> tuple[list[str], list[list[Any]]] | None:
    """Success per task type of the runs shown experience of other games, beside the runs on the
    same tasks without it: tasks solved at trial 0 / by the last trial, of the type's tasks.
    None when no run was shown experience."""
    shown = [s for s in summaries if s.experience]
    if not shown:
        return None
    tasks = set(shown[0].solved_at_trial)
    runs = [(s, label) for s, label in zip(summaries, labels, strict=True)
            if set(s.solved_at_trial) == tasks]  # fmt: skip
    header = ["task type", *(f"{label} ({s.arm}{', experience' if s.experience else ''})"
                             for s, label in runs)]  # fmt: skip
    kinds = sorted({k for s, _ in runs for k in s.by_task_type})
    rows = [[kind, *(_first_and_last(s, kind) for s, _ in runs)] for kind in kinds]
    return header, rows


def _first_and_last(s: RunSummary, kind: str) -> str:
    count = s.by_task_type.get(kind, TaskTypeCount())
    return f"{s.first_by_task_type.get(kind, 0)} / {count.solved} of {count.total}"


def calls_table(s: RunSummary) -> tuple[list[str], list[list[Any]]]:
    header = ["purpose", "calls", "prompt tokens", "cached", "completion tokens", "errors"]
    rows = [
        [p, c.calls, c.prompt, c.cached_prompt, c.completion, c.errors]
        for p, c in sorted(s.tokens_by_purpose.items())
    ]
    return header, rows


def comparison_table(rows: Sequence[ComparisonRow]) -> tuple[list[str], list[list[Any]]]:
    header = [
        "run",
        "model",
        "arm",
        "tasks",
        "success trial 0",
        "success last trial",
        "95% CI (last)",
        "tokens / solved",
        "cost / solved",
        "wall",
        "errors",
    ]
    out = [
        [
            r.label,
            r.model,
            r.arm,
            r.total_tasks,
            _pct(r.success_trial0),
            f"{_pct(r.success_last)} (trial {r.last_trial})",
            _ci(r.success_last_ci),
            _num(r.tokens_per_solved),
            _num(r.cost_per_solved, "${:.4f}"),
            f"{r.wall_s:.0f} s",
            r.errors,
        ]
        for r in rows
    ]
    return header, out


def compute_table(rows: Sequence[ComparisonRow]) -> tuple[list[str], list[list[Any]]]:
    header = ["run", "arm", "success last trial", "env steps", "env steps / solved", "tokens",
              "tokens / solved"]  # fmt: skip
    out = [
        [
            r.label, r.arm, _pct(r.success_last), r.env_steps, _num(r.env_steps_per_solved),
            r.tokens, _num(r.tokens_per_solved),
        ]
        for r in rows
    ]  # fmt: skip
    return header, out


def escalation_lines(s: RunSummary) -> list[str]:
    e = s.escalation
    if e is None:
        return []
    return [
        "### Escalation (apart from the trials)",
        "",
        f"{e.tasks} task(s) unsolved after the last trial re-run once with"
        f" {_md(', '.join(e.models))}: {e.solved} solved.",
        "",
    ]


def attempt_error_lines(s: RunSummary) -> list[str]:
    """The harness errors of every attempt (those a retry played over included), when any."""
    if not s.attempt_errors:
        return []
    rows = [[e.episode_id, e.attempt, e.kind, e.error[:200]] for e in s.attempt_errors]
    header = ["episode", "attempt", "kind", "error"]
    return [
        "### Harness errors (every attempt; tracebacks in the viewer)",
        "",
        _md_table(header, rows),
        "",
    ]


def paired_table_md(paired: Sequence[PairedTable]) -> tuple[list[str], list[list[Any]]]:
    header = ["A", "B", "trial", "tasks", "both", "only A", "only B", "neither", "p (McNemar)"]
    rows = [
        [
            p.a, p.b, p.trial, p.tasks, p.both, p.only_a, p.only_b, p.neither, _p(p.p_value),
        ]
        for p in paired
    ]  # fmt: skip
    return header, rows


def markdown_report(
    summaries: Sequence[RunSummary],
    labels: Sequence[str],
    comparison: Sequence[ComparisonRow],
    paired: Sequence[PairedTable] = (),
) -> str:
    parts = ["# reflexsim report", ""]
    if len(summaries) > 1:
        parts += ["## Model comparison", "", _md_table(*comparison_table(comparison)), ""]
        parts += [
            "## Success at equal compute",
            "",
            "Env steps include the replays a tree search spends restoring states; tokens count"
            " every call (acting, planning, values, reflections). Escalation runs are left out.",
            "",
            _md_table(*compute_table(comparison)),
            "",
        ]
        parts += ["## Paired comparison (same tasks)", ""]
        if paired:
            parts += [
                "Each task once per run: solved by the trial or not. p: McNemar's exact test"
                " (two-sided) on the tasks only one of the two runs solved.",
                "",
                _md_table(*paired_table_md(paired)),
                "",
            ]
        else:
            parts += ["No two runs played the same tasks: no paired test.", ""]
        table = experience_table(summaries, labels)
        if table is not None:
            parts += [
                "## Experience across tasks: success by task type",
                "",
                "The runs shown a gathering run's experience, beside the runs on the same tasks"
                " without it: tasks solved at trial 0 / by the last trial, of the type's tasks.",
                "",
                _md_table(*table),
                "",
            ]
    for s, label in zip(summaries, labels, strict=True):
        t = s.tokens
        parts += [
            f"## {_md(label)}: {_md(s.model)} · {_md(s.arm)} · evaluator {_md(s.evaluator)}",
            "",
            f"Solved {s.solved} of {s.total_tasks} tasks ({_pct(s.success_rate)},"
            f" {CONFIDENCE:.0%} CI {_ci(s.success_ci)});"
            f" {s.errors} errored episode(s) (harness, not agent).",
            f"Tokens: {t.prompt} prompt ({t.cached_prompt} cached), {t.completion}"
            f" completion; cost ${s.cost_usd:.4f}; wall {s.wall_s:.0f} s.",
            f"Env steps: {s.compute.env_steps}"
            + (" (replays included)" if s.compute.replay_steps_included else "")
            + ".",
            "",
            *escalation_lines(s),
            "### Model calls by purpose",
            "",
            _md_table(*calls_table(s)),
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
            _md_table(["class", "episodes"], sorted(s.failure_classes.items())),
            "",
            *attempt_error_lines(s),
        ]
    parts += ["![learning curve](learning_curve.png)", "", "![failures](failures.png)", ""]
    parts += ["![success at equal compute](compute.png)", ""]
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
    # imported here: the viewer package's server imports this module
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
        raise RunStoreError(
            f"cannot create report dir {str(out)!r}: {exc.strerror}: pass --out DIR, a folder "
            "you can write to"
        ) from None

    comparison = [
        comparison_row(lb, d, s) for lb, d, s in zip(labels, dirs, summaries, strict=True)
    ]
    paired = paired_comparisons(summaries, labels)
    if len(dirs) == 1:
        _write_json(out / "summary.json", summaries[0].to_dict())
    else:
        for label, s in zip(labels, summaries, strict=True):
            _write_json(out / f"summary-{label}.json", s.to_dict())
        _write_json(
            out / "comparison.json",
            {"runs": [asdict(r) for r in comparison], "paired": [asdict(p) for p in paired]},
        )
    plot_learning_curve(summaries, labels, out / "learning_curve.png", paired)
    plot_failures(summaries, labels, out / "failures.png")
    plot_compute(summaries, labels, out / "compute.png")
    write_text(out / "report.md", markdown_report(summaries, labels, comparison, paired))
    write_static_page(
        dirs,
        labels,
        out / "index.html",
        summaries=summaries,
        plots={
            "learning_curve": out / "learning_curve.png",
            "failures": out / "failures.png",
            "compute": out / "compute.png",
        },
        comparison=[asdict(r) for r in comparison] if len(dirs) > 1 else None,
    )
    return out


def _write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
