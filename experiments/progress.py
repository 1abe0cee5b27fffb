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

    def episode_done(self, won: bool, tokens: int) -> None: ...

    def task_done(self, won: bool, episodes_saved: int) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def begin(self, summary: dict[str, Any]) -> None:
        pass

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        pass

    def episode_done(self, won: bool, tokens: int) -> None:
        pass

    def task_done(self, won: bool, episodes_saved: int) -> None:
        pass

    def close(self) -> None:
        pass


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
