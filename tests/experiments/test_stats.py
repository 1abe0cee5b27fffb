"""Uncertainty in reports: Wilson intervals and McNemar's exact test against hand-computed values."""

from __future__ import annotations

import math
from statistics import NormalDist
from types import SimpleNamespace
from typing import Any

import pytest

from experiments.report import mcnemar_exact, paired_comparisons, paired_table, wilson_interval

Z = NormalDist().inv_cdf(0.975)


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """The textbook Wilson score interval (no continuity correction)."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def mcnemar_by_hand(b: int, c: int) -> float:
    """Two-sided exact McNemar: twice the binomial(b + c, 1/2) tail of the smaller count."""
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


@pytest.mark.parametrize("k,n", [(0, 10), (5, 10), (3, 4), (4, 4), (1, 6), (84, 134), (133, 134)])
def test_wilson_matches_the_formula(k: int, n: int) -> None:
    low, high = wilson_interval(k, n)
    assert (low, high) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_matches_published_values() -> None:
    # Newcombe (1998), table I: 0/10 and 5/10 (rounded to four places there).
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=5e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)  # no tasks: no information


@pytest.mark.parametrize(
    "b,c,expected",
    [
        (1, 6, 16 / 128),  # 2 * (1 + 7) / 2^7
        (0, 5, 2 / 32),
        (6, 1, 16 / 128),  # symmetric
        (2, 10, 2 * (1 + 12 + 66) / 4096),
        (10, 1, 2 * (1 + 11) / 2048),
        (3, 3, 1.0),  # no difference: capped at 1
        (0, 0, 1.0),  # no discordant pairs
    ],
)
def test_mcnemar_exact_p_values(b: int, c: int, expected: float) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(expected, rel=1e-12)
    assert mcnemar_exact(b, c) == pytest.approx(mcnemar_by_hand(b, c), rel=1e-12)


def summary(solved_at: dict[str, int | None], last_trial: int) -> Any:
    """The part of a run summary the paired test reads."""
    return SimpleNamespace(
        solved_at_trial=solved_at,
        total_tasks=len(solved_at),
        solved=sum(v is not None for v in solved_at.values()),
        trials=[SimpleNamespace(trial=k) for k in range(last_trial + 1)],
    )


def test_paired_table_counts_and_p_value() -> None:
    # 20 tasks: A solves 12 (two at trial 1), B solves 3; both solve 2 of them.
    games = [f"g{i}" for i in range(20)]
    a = {g: (0 if i < 10 else 1 if i < 12 else None) for i, g in enumerate(games)}
    b = {g: (0 if i in (0, 1, 19) else None) for i, g in enumerate(games)}
    table = paired_table(summary(a, 1), summary(b, 1), 1, ("A", "B"))
    assert (table.both, table.only_a, table.only_b, table.neither) == (2, 10, 1, 7)
    assert table.tasks == 20 and table.trial == 1
    assert table.p_value == pytest.approx(2 * (1 + 11) / 2**11, rel=1e-12)
    at0 = paired_table(summary(a, 1), summary(b, 1), 0, ("A", "B"))
    assert (at0.both, at0.only_a, at0.only_b, at0.neither) == (2, 8, 1, 9)


def test_pairs_only_runs_over_the_same_tasks() -> None:
    a = summary({"x": 0, "y": None, "z": 2}, 3)
    b = summary({"x": None, "y": None, "z": 1}, 1)
    other = summary({"x": 0, "w": None}, 1)
    rows = paired_comparisons([a, b, other], ["a", "b", "other"])
    # a and b share their tasks: compared at trial 0 and at trial 1 (the last both played)
    assert [(r.a, r.b, r.trial) for r in rows] == [("a", "b", 0), ("a", "b", 1)]
    assert (rows[1].both, rows[1].only_a, rows[1].only_b, rows[1].neither) == (0, 1, 1, 1)
    # a run that solved everything is known at every later trial
    done = summary({"x": 0, "y": 1, "z": 0}, 1)
    rows = paired_comparisons([a, done], ["a", "done"])
    assert [r.trial for r in rows] == [0, 3]
    assert rows[1].only_b == 1 and rows[1].both == 2
