"""What a run reports as it goes: the progress the CLI draws (library code only calls it),
and the project's log lines in ``<run dir>/run.log``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from experiments.terminal import EscapingFormatter, QuietFileHandler


class Progress(Protocol):
    """What a run reports as it goes (the CLI draws it; library code only calls it)."""

    def begin(self, summary: dict[str, Any]) -> None: ...

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None: ...

    def step_done(self, episode: str) -> None: ...

    def episode_done(self, won: bool, tokens: int, episode: str = "") -> None: ...

    def task_done(self, won: bool, episodes_saved: int) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def begin(self, summary: dict[str, Any]) -> None:
        pass

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        pass

    def step_done(self, episode: str) -> None:
        pass

    def episode_done(self, won: bool, tokens: int, episode: str = "") -> None:
        pass

    def task_done(self, won: bool, episodes_saved: int) -> None:
        pass

    def close(self) -> None:
        pass


class Eta:
    """The time a run has left, from the steps it plays rather than the episodes it ends.

    ``elapsed / episodes done x episodes left`` is far too high early on: the first episode ends
    after a whole episode's time while the others in flight, started with it, are nearly as far
    along and count for nothing (at 4 in flight it said 25 minutes left at 1 of 18 episodes of a
    17-minute run). Steps come at a steady pace from the start, so the estimate is the steps left
    over the steps per second so far; the steps left are the episodes left times the steps an
    episode takes (the finished episodes' mean, with one more episode of ``max_steps`` to
    start from), less the steps the episodes in flight have played already (at least one is
    left to each)."""

    def __init__(self, max_steps: int, began: float) -> None:
        self.max_steps, self.began = max_steps, began
        self.steps = 0  # played since ``began``
        self.finished_steps = self.finished = 0
        self.in_flight: dict[str, int] = {}  # steps played so far, by episode

    def step(self, episode: str) -> None:
        self.steps += 1
        self.in_flight[episode] = self.in_flight.get(episode, 0) + 1

    def episode_done(self, episode: str) -> None:
        self.finished_steps += self.in_flight.pop(episode, 0)
        self.finished += 1

    def seconds_left(self, now: float, episodes_left: int) -> float | None:
        """None until a step has been played."""
        elapsed = now - self.began
        if not self.steps or elapsed <= 0:
            return None
        played = sum(self.in_flight.values())
        per_episode = min(
            (self.finished_steps + played + self.max_steps) / (self.finished + 1), self.max_steps
        )
        started = min(len(self.in_flight), episodes_left)
        steps_left = (episodes_left - started) * per_episode + sum(
            max(per_episode - played, 1.0) for played in list(self.in_flight.values())[:started]
        )
        return steps_left / (self.steps / elapsed)


LOGGERS = ("reflexsim", "agents", "envs")


class RunLog:
    """INFO and above from the project's loggers into ``<run dir>/run.log`` while a run lasts
    (batch sizes, retries, crashes: what the morning reader needs); the console is left alone."""

    def __init__(self, run_dir: Path) -> None:
        self.handler = QuietFileHandler(run_dir / "run.log")
        self.handler.setFormatter(
            EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        self.handler.setLevel(logging.INFO)
        self.saved: list[tuple[logging.Logger, int]] = []

    def __enter__(self) -> None:
        for name in LOGGERS:
            logger = logging.getLogger(name)
            self.saved.append((logger, logger.level))
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        for logger, level in self.saved:
            logger.removeHandler(self.handler)
            logger.setLevel(level)
        self.handler.close()
