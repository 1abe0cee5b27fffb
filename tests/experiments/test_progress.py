"""The progress line's time left (``experiments.progress.Eta``), fed synthetic timestamps."""

from __future__ import annotations

import io

from experiments.cli import ConsoleProgress
from experiments.progress import Eta

# README line 1's shape: 18 episodes of at most 30 steps, 4 in flight, the short ones (an
# evaluator that stopped them early) among the first to end
LENGTHS = [9, 30, 30, 24, 30, 17, 30, 30, 12, 30, 26, 30, 30, 30, 21, 30, 30, 30]


def play(lengths: list[int], concurrency: int = 4) -> tuple[float, list[tuple[int, float, float]]]:
    """One model serving one step a second to the episodes in flight in turn; at each episode's
    end: (episodes done, its time, the estimate of the time left). Returns the run's end too."""
    eta = Eta(max_steps=30, began=0.0)
    now, done, waiting = 0.0, 0, [(f"e{i}", n) for i, n in enumerate(lengths)]
    flight: dict[str, int] = {}
    ends = []
    while waiting or flight:
        while waiting and len(flight) < concurrency:
            episode, steps = waiting.pop(0)
            flight[episode] = steps
        for episode in list(flight):
            now += 1.0
            eta.step(episode)
            flight[episode] -= 1
            if not flight[episode]:
                del flight[episode]
                eta.episode_done(episode)
                done += 1
                left = eta.seconds_left(now, len(lengths) - done)
                assert left is not None
                ends.append((done, now, left))
    return now, ends


def test_the_time_left_is_near_the_truth_from_the_first_episode_on() -> None:
    end, ends = play(LENGTHS)
    for done, now, left in ends:
        truth = end - now
        if len(LENGTHS) - done >= 4:  # the tail: a few steps left, any ratio is noise
            assert 0.75 * truth <= left <= 1.25 * truth, (done, left, truth)
    # counting finished episodes said nearly twice the truth at the first one's end
    done, now, _ = ends[0]
    assert now / done * (len(LENGTHS) - done) > 1.25 * (end - now)


def test_no_estimate_before_a_step_and_none_left_at_the_end() -> None:
    eta = Eta(max_steps=30, began=10.0)
    assert eta.seconds_left(20.0, 5) is None
    eta.step("a")
    eta.episode_done("a")
    assert eta.seconds_left(20.0, 0) == 0.0


def test_the_progress_line_shows_the_estimate_from_steps() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = ConsoleProgress(stream=out, every_s=60, clock=lambda: now[0])
    progress.begin(
        {
            "run_dir": "r",
            "model": "m",
            "arm": "a",
            "games": 2,
            "game_source": "s",
            "trials": 1,
            "max_steps": 10,
            "concurrency": 2,
            "workers": 1,
            "config_file": "c",
        }
    )
    progress.start(tasks=2, episodes_at_most=2, solved=0)
    for t in range(1, 11):  # a step a second, the two episodes in turn; "a" ends at 10 steps
        now[0] = 10.0 * t
        progress.step_done("a")
        progress.step_done("b")
    progress.episode_done(False, tokens=5, episode="a")
    # 20 steps in 100 s; "b", in flight with 10 played, has one step left at the least
    assert out.getvalue().splitlines()[-1].endswith("1m40s elapsed, ETA 0m05s")
