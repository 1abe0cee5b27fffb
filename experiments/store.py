"""The run store: one SQLite file (WAL) per run directory, the single source of truth.

Every step is committed as it happens; reports, exports and the viewer only read this file.
Primary keys make every write idempotent where a resumed run could repeat it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.errors import RunStoreError
from memory.records import ModelCall, Reflection, Step

DB_NAME = "run.sqlite"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    game TEXT NOT NULL,
    task_type TEXT NOT NULL,
    trial INTEGER NOT NULL,
    arm TEXT NOT NULL,
    status TEXT NOT NULL,            -- running | done | error | interrupted
    won INTEGER NOT NULL DEFAULT 0,
    failure_class TEXT,
    verdict TEXT,                    -- the heuristic evaluator's reason, if it stopped the episode
    judge_verdict TEXT,              -- the LLM judge's opinion (never the success metric)
    judge_reason TEXT,
    error TEXT,
    prompt_prefix TEXT NOT NULL,     -- instruction + examples + memory: the fixed part of each prompt
    observation TEXT NOT NULL,       -- the first observation
    task TEXT NOT NULL DEFAULT '',
    memory_json TEXT NOT NULL DEFAULT '[]',  -- the reflections shown in this episode's prompt
    attempts INTEGER NOT NULL DEFAULT 1,
    resimulated INTEGER NOT NULL DEFAULT 0,  -- times it was rebuilt from recorded actions
    started_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS episodes_trial ON episodes(trial);
CREATE TABLE IF NOT EXISTS steps (
    episode_id TEXT NOT NULL REFERENCES episodes(episode_id),
    idx INTEGER NOT NULL,
    kind TEXT NOT NULL,              -- act | think | invalid
    raw_output TEXT NOT NULL,        -- the model's text, untrusted
    action TEXT NOT NULL,            -- what was executed after parsing and grounding
    observation TEXT NOT NULL,
    admissible INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    reward REAL NOT NULL,
    won INTEGER NOT NULL,
    verdict TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (episode_id, idx)
);
CREATE TABLE IF NOT EXISTS reflections (
    task TEXT NOT NULL,
    trial INTEGER NOT NULL,
    episode_id TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_hash TEXT NOT NULL,
    text TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    PRIMARY KEY (task, trial)
);
CREATE TABLE IF NOT EXISTS trials (
    trial INTEGER PRIMARY KEY,
    tasks_json TEXT NOT NULL,        -- the tasks this trial ran (the unsolved ones)
    started_at REAL NOT NULL,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS model_calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    purpose TEXT NOT NULL,           -- act | reflect | judge | plan | value | ...
    game TEXT NOT NULL,
    trial INTEGER NOT NULL,
    episode_id TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    retries INTEGER NOT NULL,
    error TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,              -- retry | worker_crash | infra_error | budget | resume | ...
    episode_id TEXT,
    detail TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class EpisodeRow:
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
    judge_reason: str | None
    error: str | None
    prompt_prefix: str
    observation: str
    task: str
    memory_json: str
    attempts: int
    resimulated: int
    started_at: float
    finished_at: float | None


STEP_COLUMNS = (
    "idx", "kind", "raw_output", "action", "observation", "admissible", "prompt_tokens",
    "completion_tokens", "cached_tokens", "latency_s", "reward", "won", "verdict",
)  # fmt: skip


def _episode_row(row: sqlite3.Row) -> EpisodeRow:
    d = dict(row)
    d["won"] = bool(d["won"])
    return EpisodeRow(**d)


def episode_id(game: str, trial: int) -> str:
    """Stable across resumes: a run directory holds one arm, so (game, trial) is unique."""
    return f"{game}#t{trial}"


class RunStore:
    """Read/write access to one run's database. Writes are committed immediately."""

    def __init__(
        self, run_dir: str | Path, *, create: bool = False, readonly: bool = False
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if create:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunStoreError(
                    f"cannot create run dir {str(self.run_dir)!r}: {exc.strerror}"
                ) from None
        elif not self.path.is_file():
            raise RunStoreError(f"{str(self.run_dir)!r} is not a run directory (no {DB_NAME})")
        if readonly:
            uri = f"file:{self.path}?mode=ro"
            self.conn = sqlite3.connect(
                uri, uri=True, isolation_level=None, check_same_thread=False
            )
        else:
            self.conn = sqlite3.connect(
                self.path, isolation_level=None, timeout=30, check_same_thread=False
            )
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA)
            self.conn.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        self.conn.row_factory = sqlite3.Row

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- meta / manifest -------------------------------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        self.conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value, sort_keys=True)),
        )

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    # -- episodes and steps ----------------------------------------------------------------
    def start_episode(
        self,
        *,
        episode_id: str,
        game: str,
        task_type: str,
        trial: int,
        arm: str,
        prompt_prefix: str,
        observation: str,
        task: str,
        memory: Sequence[Reflection],
    ) -> None:
        self.conn.execute(
            "INSERT INTO episodes(episode_id, game, task_type, trial, arm, status, prompt_prefix,"
            " observation, task, memory_json, started_at) VALUES (?,?,?,?,?,'running',?,?,?,?,?)",
            (
                episode_id, game, task_type, trial, arm, prompt_prefix, observation, task,
                json.dumps([r.to_dict() for r in memory]), time.time(),
            ),
        )  # fmt: skip

    def add_step(self, episode: str, step: Step) -> None:
        values = [step.index] + [getattr(step, c) for c in STEP_COLUMNS[1:]]
        self.conn.execute(
            f"INSERT INTO steps(episode_id, {', '.join(STEP_COLUMNS)}, created_at)"
            f" VALUES (?, {', '.join('?' * len(STEP_COLUMNS))}, ?)",
            (episode, *values, time.time()),
        )

    def finish_episode(
        self,
        episode: str,
        *,
        status: str,
        won: bool,
        failure_class: str | None = None,
        verdict: str | None = None,
        error: str | None = None,
    ) -> None:
        self.conn.execute(
            "UPDATE episodes SET status=?, won=?, failure_class=?, verdict=?, error=?, finished_at=?"
            " WHERE episode_id=?",
            (status, int(won), failure_class, verdict, error, time.time(), episode),
        )

    def set_judge(self, episode: str, verdict: str, reason: str) -> None:
        self.conn.execute(
            "UPDATE episodes SET judge_verdict=?, judge_reason=? WHERE episode_id=?",
            (verdict, reason, episode),
        )

    def mark_resimulated(self, episode: str) -> None:
        self.conn.execute(
            "UPDATE episodes SET resimulated = resimulated + 1 WHERE episode_id=?", (episode,)
        )

    def retry_episode(self, episode: str) -> None:
        """Forget an errored episode's steps so it is played again from the start."""
        with self.transaction():
            self.conn.execute("DELETE FROM steps WHERE episode_id=?", (episode,))
            self.conn.execute(
                "UPDATE episodes SET status='running', won=0, failure_class=NULL, verdict=NULL,"
                " error=NULL, finished_at=NULL, attempts=attempts+1 WHERE episode_id=?",
                (episode,),
            )

    def discard_episode(self, episode: str) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM steps WHERE episode_id=?", (episode,))
            self.conn.execute("DELETE FROM episodes WHERE episode_id=?", (episode,))

    def episode(self, episode: str) -> EpisodeRow | None:
        row = self.conn.execute("SELECT * FROM episodes WHERE episode_id=?", (episode,)).fetchone()
        return _episode_row(row) if row else None

    def episodes(self, trial: int | None = None) -> list[EpisodeRow]:
        if trial is None:
            rows = self.conn.execute("SELECT * FROM episodes ORDER BY trial, game").fetchall()
        else:
            rows = self.conn.execute(
                "SELECT * FROM episodes WHERE trial=? ORDER BY game", (trial,)
            ).fetchall()
        return [_episode_row(r) for r in rows]

    def steps(self, episode: str) -> list[Step]:
        rows = self.conn.execute(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE episode_id=? ORDER BY idx",
            (episode,),
        ).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["index"] = d.pop("idx")
            d["admissible"] = bool(d["admissible"])
            d["won"] = bool(d["won"])
            out.append(Step(**d))
        return out

    # -- reflections -----------------------------------------------------------------------
    def add_reflection(
        self, r: Reflection, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO reflections(task, trial, episode_id, model, prompt_hash, text,"
            " prompt_tokens, completion_tokens, created_at) VALUES (?,?,?,?,?,?,?,?,?)",
            (r.task, r.trial, r.episode_id, r.model, r.prompt_hash, r.text, prompt_tokens,
             completion_tokens, time.time()),
        )  # fmt: skip

    def reflections(self, task: str | None = None) -> list[Reflection]:
        cols = "task, trial, episode_id, model, prompt_hash, text"
        if task is None:
            rows = self.conn.execute(
                f"SELECT {cols} FROM reflections ORDER BY task, trial"
            ).fetchall()
        else:
            rows = self.conn.execute(
                f"SELECT {cols} FROM reflections WHERE task=? ORDER BY trial", (task,)
            ).fetchall()
        return [Reflection(**dict(r)) for r in rows]

    # -- trials and events -----------------------------------------------------------------
    def start_trial(self, trial: int, tasks: Sequence[str]) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO trials(trial, tasks_json, started_at) VALUES (?,?,?)",
            (trial, json.dumps(list(tasks)), time.time()),
        )

    def join_trial(self, trial: int, game: str) -> None:
        """Record that ``game`` runs in trial ``trial`` (tasks advance through trials on their
        own, so a trial's task list grows as its tasks reach it)."""
        with self.transaction():
            row = self.conn.execute(
                "SELECT tasks_json FROM trials WHERE trial=?", (trial,)
            ).fetchone()
            if row is None:
                self.conn.execute(
                    "INSERT INTO trials(trial, tasks_json, started_at) VALUES (?,?,?)",
                    (trial, json.dumps([game]), time.time()),
                )
                return
            tasks = json.loads(row["tasks_json"])
            if game not in tasks:
                self.conn.execute(
                    "UPDATE trials SET tasks_json=? WHERE trial=?",
                    (json.dumps(sorted([*tasks, game])), trial),
                )

    def add_model_call(self, call: ModelCall) -> None:
        """One model call of any purpose, with what it cost."""
        self.conn.execute(
            "INSERT INTO model_calls(purpose, game, trial, episode_id, prompt_tokens,"
            " completion_tokens, cached_tokens, latency_s, retries, error, created_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (call.purpose, call.game, call.trial, call.episode_id, call.prompt_tokens,
             call.completion_tokens, call.cached_tokens, call.latency_s, call.retries,
             call.error, time.time()),
        )  # fmt: skip

    def finish_trial(self, trial: int) -> None:
        self.conn.execute("UPDATE trials SET finished_at=? WHERE trial=?", (time.time(), trial))

    def trials(self) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT * FROM trials ORDER BY trial").fetchall()
        return [{**dict(r), "tasks": json.loads(r["tasks_json"])} for r in rows]

    def log_event(self, kind: str, detail: str, episode: str | None = None) -> None:
        self.conn.execute(
            "INSERT INTO events(ts, kind, episode_id, detail) VALUES (?,?,?,?)",
            (time.time(), kind, episode, detail),
        )

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if kind is None:
            rows = self.conn.execute("SELECT * FROM events ORDER BY id").fetchall()
        else:
            rows = self.conn.execute(
                "SELECT * FROM events WHERE kind=? ORDER BY id", (kind,)
            ).fetchall()
        return [dict(r) for r in rows]

    def token_totals(self) -> dict[str, int]:
        row = self.conn.execute(
            "SELECT COALESCE(SUM(prompt_tokens),0) p, COALESCE(SUM(completion_tokens),0) c,"
            " COALESCE(SUM(cached_tokens),0) k FROM steps"
        ).fetchone()
        ref = self.conn.execute(
            "SELECT COALESCE(SUM(prompt_tokens),0) p, COALESCE(SUM(completion_tokens),0) c FROM reflections"
        ).fetchone()
        return {
            "prompt": row["p"] + ref["p"],
            "completion": row["c"] + ref["c"],
            "cached_prompt": row["k"],
        }
