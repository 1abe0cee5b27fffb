"""The run store: one SQLite file (WAL) per run directory, the single source of truth.

All SQL of the project lives in this module. ``RunStore`` writes: every step is committed as it
happens, and primary keys make every write idempotent where a resumed run could repeat it.
``RunReader`` (``open_reader``) reads through a read-only connection and returns frozen records
with enum statuses and kinds; reports, export, replay and the viewer read only through it.

Tables added without a version step (``_TABLES_ADDED``: search trees, reflection notes,
escalations) are created by every writer that opens a store, so a version-2 store made before
them gains them on its next write; a reader of a store that lacks them sees them empty. Nullable
columns added the same way (``_COLUMNS_ADDED``: the experience each episode was shown) are added
by every writer; a reader of a store without them reads NULL. So are the columns that keep each
model call as its backend sent it (``SENT_COLUMNS``; see :meth:`RunStore.add_model_call`): a
call recorded before them reads back with ``sent`` None, and readers rebuild and mark its prompt
(:mod:`experiments.prompts`).

Schema versions: a store records its version in ``meta``. Opening a version-1 store for writing
migrates it in place (``model_calls`` created and backfilled from steps and reflections; a
``migrate`` event records it). Opening one read-only never writes to the file: the same rows are
derived by temporary views on the connection, so committed or shared runs render unchanged. A
store newer than this code, or one without a version, is refused with a one-line error.

Damage and a full disk: every connection is a ``_Connection``, whose statements and fetches turn
SQLite's "malformed" / "not a database" into :class:`StoreDamagedError` (naming what still reads
and how to recover it) and "database or disk is full" into :class:`StoreFullError`, in one place
for every read and write. Opening an existing store runs ``PRAGMA quick_check`` (a reader only
when the file is small, or when asked), so a damaged store is refused before a resume plays on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Self, TypeVar

from agents.llm.answers import storable_data
from agents.llm.pricing import cost_usd
from experiments.errors import RunStoreError, StoreDamagedError, StoreFullError
from experiments.lock import holder_alive
from memory.records import (
    EpisodeStatus,
    FailureClass,
    ModelCall,
    Reflection,
    ReflectionNote,
    SearchEnd,
    SearchIteration,
    SearchNode,
    SearchTree,
    SentRequest,
    Step,
    StepKind,
)

DB_NAME = "run.sqlite"
LOCK_NAME = "run.lock"  # held by the one process that writes the run (experiments.lock)
SCHEMA_VERSION = 2

# Version 1: the tables of every store (unchanged since the first release).
_TABLES_V1 = (
    """CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    game TEXT NOT NULL,
    task_type TEXT NOT NULL,
    trial INTEGER NOT NULL,
    arm TEXT NOT NULL,
    status TEXT NOT NULL,            -- an EpisodeStatus value
    won INTEGER NOT NULL DEFAULT 0,
    failure_class TEXT,              -- a FailureClass value
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
    finished_at REAL,
    seed INTEGER                     -- the sampling seed of the episode's actor requests
)""",
    "CREATE INDEX IF NOT EXISTS episodes_trial ON episodes(trial)",
    """CREATE TABLE IF NOT EXISTS steps (
    episode_id TEXT NOT NULL REFERENCES episodes(episode_id),
    idx INTEGER NOT NULL,
    kind TEXT NOT NULL,              -- a StepKind value
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
    verdict TEXT,                    -- unused (always NULL): an episode's verdict is on its row
    created_at REAL NOT NULL,
    PRIMARY KEY (episode_id, idx)
)""",
    """CREATE TABLE IF NOT EXISTS reflections (
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
)""",
    """CREATE TABLE IF NOT EXISTS trials (
    trial INTEGER PRIMARY KEY,
    tasks_json TEXT NOT NULL,        -- the tasks this trial ran (the unsolved ones)
    started_at REAL NOT NULL,
    finished_at REAL
)""",
    """CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,              -- retry | worker_crash | infra_error | budget | resume | ...
    episode_id TEXT,
    detail TEXT NOT NULL
)""",
)

# Version 2: one row per model call of any purpose, and running totals kept by a trigger, so
# budgets and the progress line read a few rows instead of summing every call.
_TABLES_V2 = (
    """CREATE TABLE IF NOT EXISTS model_calls (
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
    error TEXT,                      -- the call failed after its retries: why
    created_at REAL NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS model_calls_episode ON model_calls(episode_id)",
    """CREATE TABLE IF NOT EXISTS call_totals (
    purpose TEXT PRIMARY KEY,
    calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    retries INTEGER NOT NULL,
    errors INTEGER NOT NULL
)""",
    """CREATE TRIGGER IF NOT EXISTS model_calls_count AFTER INSERT ON model_calls BEGIN
    INSERT INTO call_totals(purpose, calls, prompt_tokens, completion_tokens, cached_tokens,
                            latency_s, retries, errors)
    VALUES (NEW.purpose, 1, NEW.prompt_tokens, NEW.completion_tokens, NEW.cached_tokens,
            NEW.latency_s, NEW.retries, NEW.error IS NOT NULL)
    ON CONFLICT(purpose) DO UPDATE SET
        calls = calls + 1,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens,
        cached_tokens = cached_tokens + excluded.cached_tokens,
        latency_s = latency_s + excluded.latency_s,
        retries = retries + excluded.retries,
        errors = errors + excluded.errors;
END""",
    "CREATE INDEX IF NOT EXISTS episodes_won ON episodes(game) WHERE won = 1",
)

# Added to version 2 without a version step: every writer creates them if they are missing.
_TABLES_ADDED = (
    """CREATE TABLE IF NOT EXISTS search_nodes (
    episode_id TEXT NOT NULL,
    node_id INTEGER NOT NULL,
    parent_id INTEGER,               -- NULL: the root (the first observation)
    depth INTEGER NOT NULL,
    kind TEXT NOT NULL,              -- a StepKind value ('' for the root)
    raw_output TEXT NOT NULL,        -- the model's text, untrusted
    action TEXT NOT NULL,
    observation TEXT,                -- NULL until the node was executed
    admissible INTEGER NOT NULL,
    value REAL NOT NULL,             -- the value function's estimate
    visits INTEGER NOT NULL,
    total REAL NOT NULL,             -- sum of the back-propagated rewards
    samples INTEGER NOT NULL,        -- samples of the expansion that proposed this action
    terminal INTEGER NOT NULL,
    won INTEGER NOT NULL,
    chosen INTEGER NOT NULL,         -- on the path written as the episode's steps
    reflection TEXT,                 -- written after a failed rollout that ended here
    iteration INTEGER NOT NULL,      -- the iteration that created it
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (episode_id, node_id)
)""",
    """CREATE TABLE IF NOT EXISTS search_iterations (
    episode_id TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    selected INTEGER NOT NULL,
    leaf INTEGER NOT NULL,
    reward REAL NOT NULL,
    env_steps INTEGER NOT NULL,      -- actions stepped for the first time
    replay_steps INTEGER NOT NULL,   -- actions re-simulated to restore a node
    resets INTEGER NOT NULL,
    nodes_added INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    backtrack INTEGER NOT NULL,
    elapsed_s REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (episode_id, iteration)
)""",
    """CREATE TABLE IF NOT EXISTS search_ends (
    episode_id TEXT PRIMARY KEY,
    best_node INTEGER NOT NULL,
    won INTEGER NOT NULL,
    reason TEXT NOT NULL,
    created_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS reflection_notes (
    task TEXT NOT NULL,
    trial INTEGER NOT NULL,
    format TEXT NOT NULL,            -- free | critique | epm
    chars INTEGER NOT NULL,          -- of the text kept
    truncated_from INTEGER,          -- the text's length before the cap, when it was cut
    parse_error TEXT,                -- critique: why the JSON was refused (free text kept)
    raw TEXT NOT NULL,               -- the model's text, untrusted
    PRIMARY KEY (task, trial)
)""",
    """CREATE TABLE IF NOT EXISTS escalations (
    episode_id TEXT PRIMARY KEY,     -- its row in episodes; kept out of the trial outcomes
    game TEXT NOT NULL,
    model TEXT NOT NULL,
    created_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS task_ends (
    game TEXT PRIMARY KEY,           -- a task whose trials are over under the run's plan
    trial INTEGER NOT NULL,          -- the trial that ended it
    reason TEXT NOT NULL,            -- a TaskEnd value
    created_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS episode_errors (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    episode_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,        -- the episode's attempt it ended (1: the first)
    kind TEXT NOT NULL,              -- infra_error | engine_restart
    error TEXT NOT NULL,             -- one line
    traceback TEXT NOT NULL,         -- the whole traceback, causes included
    created_at REAL NOT NULL
)""",
)
_ADDED_NAMES = ("search_nodes", "search_iterations", "search_ends", "reflection_notes",
                "escalations", "task_ends", "episode_errors")  # fmt: skip

# Nullable columns added to version 2 without a version step: (table, column, declaration); every
# writer adds those missing, a reader of an older store reads NULL.
_COLUMNS_ADDED = (
    # the experience of other games shown in the episode's prompt (agents.experience.Shown)
    ("episodes", "experience_json", "TEXT"),
    # each model call as its backend sent it and as it came back (see add_model_call); NULL in
    # calls recorded before requests were
    ("model_calls", "step", "INTEGER"),  # the call site's step
    ("model_calls", "prompt_form", "TEXT"),  # text | messages (memory.records.SentRequest)
    ("model_calls", "prompt_base", "INTEGER"),  # the earlier call whose text this one extends
    ("model_calls", "prompt_keep", "INTEGER"),  # characters of the base's text kept
    ("model_calls", "prompt_text", "TEXT"),  # what follows them (all of it without a base)
    # every other field sent (sampling, stop, ...); NULL: the base call's
    ("model_calls", "request_json", "TEXT"),
    ("model_calls", "answer", "TEXT"),  # the model's text, untrusted
    ("model_calls", "finish_reason", "TEXT"),
    ("model_calls", "alternatives_json", "TEXT"),  # the other samples (n > 1)
    ("model_calls", "attempt_errors_json", "TEXT"),  # why each failed attempt failed
)
SENT_COLUMNS = tuple(c for t, c, _ in _COLUMNS_ADDED if t == "model_calls")
# A call's text is stored as what it adds to an earlier call's of the same episode (or task
# trial) when they share at least this many leading characters; else whole.
MIN_SHARED_CHARS = 64
_RECENT_KEYS = 512  # episodes (and task trials) whose last texts the writer keeps in memory

_NODE_COLUMNS = tuple(f.name for f in dataclasses.fields(SearchNode))
_ITERATION_COLUMNS = tuple(f.name for f in dataclasses.fields(SearchIteration))

_CALL_COLUMNS = (
    "purpose, game, trial, episode_id, prompt_tokens, completion_tokens, cached_tokens,"
    " latency_s, retries, error, created_at"
)

# The model calls a version-1 store implies: one act call per step, one reflect call per
# reflection (v1 recorded no judge tokens). The migration inserts these rows; a read-only
# connection sees the same rows through a temporary view.
_V1_CALLS = f"""SELECT {_CALL_COLUMNS} FROM (
    SELECT 'act' AS purpose, e.game AS game, e.trial AS trial, s.episode_id AS episode_id,
        s.prompt_tokens AS prompt_tokens, s.completion_tokens AS completion_tokens,
        s.cached_tokens AS cached_tokens, s.latency_s AS latency_s, 0 AS retries,
        NULL AS error, s.created_at AS created_at
    FROM steps s JOIN episodes e ON e.episode_id = s.episode_id
    UNION ALL
    SELECT 'reflect', r.task, r.trial, r.episode_id, r.prompt_tokens, r.completion_tokens, 0,
        0.0, 0, NULL, r.created_at
    FROM reflections r
) ORDER BY created_at"""

_V1_READ_VIEWS = (
    f"""CREATE TEMP VIEW model_calls AS
    SELECT row_number() OVER (ORDER BY created_at) AS id, {_CALL_COLUMNS} FROM ({_V1_CALLS})""",
    """CREATE TEMP VIEW call_totals AS
    SELECT purpose, COUNT(*) AS calls, SUM(prompt_tokens) AS prompt_tokens,
        SUM(completion_tokens) AS completion_tokens, SUM(cached_tokens) AS cached_tokens,
        SUM(latency_s) AS latency_s, SUM(retries) AS retries, SUM(error IS NOT NULL) AS errors
    FROM model_calls GROUP BY purpose""",
)

STEP_COLUMNS = (
    "idx", "kind", "raw_output", "action", "observation", "admissible", "prompt_tokens",
    "completion_tokens", "cached_tokens", "latency_s", "reward", "won",
)  # fmt: skip

_OUTCOME_COLUMNS = (
    "episode_id, game, task_type, trial, arm, status, won, failure_class, verdict, judge_verdict,"
    " started_at, finished_at"
)


# -- records -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """An episode without its prompt and steps: what reports and the task list need."""

    episode_id: str
    game: str
    task_type: str
    trial: int
    arm: str
    status: EpisodeStatus
    won: bool
    failure_class: FailureClass | None
    verdict: str | None
    judge_verdict: str | None
    started_at: float
    finished_at: float | None


@dataclass(frozen=True)
class EpisodeRow(Outcome):
    """An episode's outcome with its prompt prefix and the rest of its row (steps are read
    separately)."""

    judge_reason: str | None
    error: str | None
    prompt_prefix: str
    observation: str
    task: str
    memory_json: str
    attempts: int
    resimulated: int
    seed: int | None = None  # the actor's sampling seed (None in stores older than v2)
    # the experience of other games its prompt showed (JSON; None: the run was given none, or
    # the store is older than the column)
    experience_json: str | None = None


@dataclass(frozen=True)
class StepCounts:
    """How one episode's steps split by kind."""

    steps: int = 0
    invalid: int = 0
    inadmissible: int = 0  # acts the game did not list as admissible
    thoughts: int = 0


@dataclass(frozen=True)
class TrialRow:
    trial: int
    tasks: tuple[str, ...]  # the tasks this trial ran (the unsolved ones)
    started_at: float
    finished_at: float | None


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    kind: str
    episode_id: str | None
    detail: str


@dataclass(frozen=True)
class EpisodeError:
    """One harness failure of an episode's attempt, kept when the episode is played again."""

    episode_id: str
    attempt: int
    kind: str  # infra_error | engine_restart
    error: str
    traceback: str
    created_at: float


@dataclass(frozen=True)
class Tokens:
    """Tokens of model calls, summed."""

    prompt: int
    completion: int
    cached_prompt: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(
            self.prompt + other.prompt,
            self.completion + other.completion,
            self.cached_prompt + other.cached_prompt,
        )

    def __sub__(self, other: Tokens) -> Tokens:
        return Tokens(
            self.prompt - other.prompt,
            self.completion - other.completion,
            self.cached_prompt - other.cached_prompt,
        )

    def cost_usd(self, model: str) -> float:
        """What these tokens cost with ``model`` (a model spec; 0 for a local one). A store
        written before servers' counts were checked (:mod:`agents.llm.answers`) may hold
        negative ones: they cost nothing."""
        counts = (max(n, 0) for n in (self.prompt, self.completion, self.cached_prompt))
        return float(cost_usd(model, *counts))


@dataclass(frozen=True)
class CallTotals:
    """The model calls of one purpose, summed."""

    calls: int
    prompt: int
    completion: int
    cached_prompt: int
    latency_s: float
    retries: int
    errors: int


@dataclass(frozen=True)
class Progress:
    """What the progress line shows after each episode."""

    solved: int  # distinct tasks won in any trial
    tokens: int  # prompt + completion tokens of every model call


@dataclass(frozen=True)
class TaskUsage:
    """What one task has used so far, across its trials (per-task budgets read it)."""

    tokens: int  # prompt + completion tokens of every model call for the task
    seconds: float  # its episodes' durations plus its calls between episodes


@dataclass(frozen=True)
class Escalation:
    """An unsolved task re-run once with another model, reported apart from the trials."""

    outcome: Outcome
    model: str


class TaskEnd(StrEnum):
    """Why a task has no trial left to play (the trial loop's rules)."""

    SOLVED = "solved"  # won: its later trials are skipped
    TRIALS = "trials"  # every trial played (and its escalation run, if any)
    OSCILLATING = "oscillating"  # a trial repeated an earlier one's actions
    TASK_BUDGET = "task_budget"  # it used up its token or time budget


class RunStatus(StrEnum):
    """Where a run stands, derived from its store (never a flag written on the way out)."""

    COMPLETE = "complete"  # every planned task finished, or was given up by a rule
    RUNNING = "running"  # a live process holds the run's lock
    STOPPED = "stopped"  # a budget or deadline stopped it; --resume (with more) goes on
    INTERRUPTED = "interrupted"  # a signal, a crash or kill -9 ended it; --resume goes on
    ERRORS = "errors"  # it ended with tasks left by infrastructure errors; --resume retries


@dataclass(frozen=True)
class RunState:
    """A run's status and the counts behind it (:meth:`RunReader.run_state`)."""

    status: RunStatus
    tasks: int  # planned tasks (the manifest's games)
    finished: int  # of them, those with no trial left (a TaskEnd recorded this session)
    errors: int  # episodes that ended as infrastructure errors (--resume plays them again)
    stopped: str | None = None  # the budget or deadline that stopped it
    ended: str | None = None  # how the last process to run it ended, if it could say

    @property
    def complete(self) -> bool:
        return self.status == RunStatus.COMPLETE

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status.value, "complete": self.complete}


# How a process that ran a run ended (the ``end`` event's ``how``); kill -9 writes none.
ENDED_STATUS = {
    "finished": RunStatus.ERRORS,  # a finished pass that is not complete left tasks to errors
    "stopped": RunStatus.STOPPED,
    "interrupted": RunStatus.INTERRUPTED,
    "crashed": RunStatus.INTERRUPTED,
}
SESSION_EVENTS = ("start", "resume", "end")  # the events that open and close a process's run


def escalation_id(game: str) -> str:
    """The episode id of a task's escalation run."""
    return f"{game}#escalate"


def episode_id(game: str, trial: int) -> str:
    """Stable across resumes: a run directory holds one arm, so (game, trial) is unique."""
    return f"{game}#t{trial}"


_E = TypeVar("_E", bound=StrEnum)


def _enum(kind: type[_E], value: str, where: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        raise RunStoreError(
            f"unknown {kind.__name__} {value!r} in {where}: upgrade reflexsim to read this run"
        ) from None


def _episode_fields(d: dict[str, Any]) -> dict[str, Any]:
    where = f"episode {d['episode_id']!r}"
    d["won"] = bool(d["won"])
    d["status"] = _enum(EpisodeStatus, d["status"], where)
    if d["failure_class"] is not None:
        d["failure_class"] = _enum(FailureClass, d["failure_class"], where)
    return d


def shared_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (compared in C, halving the range)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _json_list(items: Sequence[str]) -> str | None:
    return json.dumps(list(items), ensure_ascii=False) if items else None


def _step(row: Mapping[str, Any], episode: str) -> Step:
    d = dict(row)
    d["index"] = d.pop("idx")
    d["kind"] = _enum(StepKind, d["kind"], f"episode {episode!r}")
    d["admissible"] = bool(d["admissible"])
    d["won"] = bool(d["won"])
    return Step(**d)


# -- damage and a full disk ----------------------------------------------------------------------
# SQLite's primary result codes (``sqlite3.Error.sqlite_errorcode & 0xff``).
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 10, 11, 13, 26
_MAIN_TABLES = ("episodes", "steps", "model_calls", "reflections", "events")
# A reader checks the file on open when it is at most this big (a writer always does).
QUICK_CHECK_MAX_BYTES = 256 * 2**20


def _intact(path: Path) -> str:
    """What of a damaged store still reads, in words (rows per main table)."""
    parts = []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return "nothing in it reads"
    try:
        for table in _MAIN_TABLES:
            try:
                (n,) = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
                parts.append(f"{table}: {n} rows")
            except sqlite3.Error:
                parts.append(f"{table}: unreadable")
    finally:
        conn.close()
    if all(p.endswith("unreadable") for p in parts):
        return "nothing in it reads"
    return "what still reads: " + ", ".join(parts)


def _no_space(path: Path) -> bool:
    """The file system holding ``path`` has (next to) no space left: a "disk I/O error" there
    (growing the WAL index, say) is a full disk."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024


def _damaged(path: Path, what: str) -> StoreDamagedError:
    what = " ".join(what.split())  # quick_check's findings span lines: the error is one
    return StoreDamagedError(
        f"cannot read the run store {str(path)!r}: it is damaged ({what}); {_intact(path)}."
        f" Recover what reads with: sqlite3 {str(path)!r} .recover > recovered.sql, then load"
        f" it into a new store (sqlite3 NEW_RUN/{DB_NAME} < recovered.sql); do not resume this one"
    )


def store_error(exc: sqlite3.Error, path: Path) -> RunStoreError | None:
    """The one-line error for a damaged store or a full disk; None for any other SQLite error."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    text = str(exc)
    if (
        code == _SQLITE_FULL
        or "disk is full" in text
        or (code == _SQLITE_IOERR and _no_space(path))
    ):
        return StoreFullError(
            f"the disk holding {str(path)!r} is full ({text}): the run stopped; what was "
            f"recorded is kept; free space, then --resume {str(path.parent)!r}"
        )
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in text or "not a database" in text:
        return _damaged(path, text)
    return None


class _Cursor(sqlite3.Cursor):
    """A cursor whose statements and fetches raise ``store_error`` where it applies."""

    connection: _Connection

    def _mapped(self, exc: sqlite3.Error) -> BaseException:
        return store_error(exc, self.connection.store_path) or exc

    def execute(self, sql: str, parameters: Any = (), /) -> Self:
        try:
            return super().execute(sql, parameters)
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> Self:
        try:
            return super().executemany(sql, seq_of_parameters)
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None

    def fetchmany(self, size: int | None = 1) -> list[Any]:
        try:
            return super().fetchmany(size)
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.Error as exc:
            raise self._mapped(exc) from None


class _Connection(sqlite3.Connection):
    """A connection to a run store: every statement runs on a :class:`_Cursor`."""

    store_path: Path

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        return self.cursor(_Cursor).execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> _Cursor:
        return self.cursor(_Cursor).executemany(sql, seq_of_parameters)


def _connect(path: Path, *, readonly: bool) -> _Connection:
    target, uri = (f"file:{path}?mode=ro", True) if readonly else (str(path), False)
    conn = sqlite3.connect(
        target,
        uri=uri,
        isolation_level=None,
        timeout=30,
        check_same_thread=False,
        factory=_Connection,
    )
    assert isinstance(conn, _Connection)
    conn.store_path = path
    return conn


def _quick_check(conn: _Connection) -> None:
    """A damaged file (bad pages, truncated, garbage inside) raises StoreDamagedError."""
    rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    problems = [str(r[0]) for r in rows if r[0] != "ok"]
    if problems:
        raise _damaged(conn.store_path, f"quick_check: {'; '.join(problems)}")


# -- opening and versions ------------------------------------------------------------------------
def _stored_version(conn: sqlite3.Connection, run_dir: Path) -> int | None:
    """The store's schema version; None for an empty database (a new store)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return None
    row = (
        conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if "meta" in tables
        else None
    )
    try:
        version = int(row[0]) if row is not None else 0
    except ValueError:
        version = 0
    if version < 1:
        raise RunStoreError(
            f"{str(run_dir / DB_NAME)!r} has no schema version: it is not a reflexsim run store;"
            " move it away or pick another run directory"
        )
    if version > SCHEMA_VERSION:
        raise RunStoreError(
            f"{str(run_dir / DB_NAME)!r} has schema version {version}, newer than this reflexsim"
            f" reads ({SCHEMA_VERSION}): upgrade reflexsim (pip install -U reflexsim)"
        )
    return version


def _migrate_v1(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE episodes ADD COLUMN seed INTEGER")
    for statement in _TABLES_V2:
        conn.execute(statement)
    conn.execute(f"INSERT INTO model_calls({_CALL_COLUMNS}) {_V1_CALLS}")
    (calls,) = conn.execute("SELECT COUNT(*) FROM model_calls").fetchone()
    conn.execute(
        "INSERT INTO events(ts, kind, episode_id, detail) VALUES (?, 'migrate', NULL, ?)",
        (time.time(), json.dumps({"from": 1, "to": 2, "model_calls": calls})),
    )


# Version -> the step to the next version (in one transaction), and the temporary views that let
# a read-only connection read that version as if it were current.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_v1}
_READ_VIEWS: dict[int, tuple[str, ...]] = {1: _V1_READ_VIEWS}


def _present(conn: sqlite3.Connection) -> frozenset[str]:
    """Which of the tables added without a version step this store has."""
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
    return frozenset(r[0] for r in rows) & frozenset(_ADDED_NAMES)


@contextmanager
def _opening(conn: sqlite3.Connection, run_dir: Path) -> Iterator[None]:
    """Close ``conn`` when opening the store fails; an SQLite error becomes a one-line
    RunStoreError."""
    try:
        yield
    except sqlite3.Error as exc:
        conn.close()
        raise RunStoreError(f"cannot read the run store in {str(run_dir)!r}: {exc}") from None
    except RunStoreError:
        conn.close()
        raise


class RunReader:
    """Typed, read-only access to one run's store (also the read half of ``RunStore``)."""

    run_dir: Path
    path: Path
    schema_version: int  # the file's (a reader reads an older store through views)
    _conn: sqlite3.Connection
    _added: frozenset[str]  # the tables added without a version step that this store has

    def __init__(self, run_dir: str | Path, *, check: bool | None = None) -> None:
        """``check``: run ``PRAGMA quick_check`` first (None: when the file is small)."""
        self._locate(run_dir)
        self._conn = _connect(self.path, readonly=True)
        if check is None:
            check = self.path.stat().st_size <= QUICK_CHECK_MAX_BYTES
        with _opening(self._conn, self.run_dir):
            version = _stored_version(self._conn, self.run_dir)
            if check and version is not None:
                _quick_check(self._conn)
            if version is None:
                raise RunStoreError(
                    f"{str(self.run_dir)!r} is not a run directory (its {DB_NAME} is empty)"
                )
            for statement in _READ_VIEWS.get(version, ()):
                self._conn.execute(statement)
        self.schema_version = version
        self._conn.row_factory = sqlite3.Row
        self._added = _present(self._conn)

    def _locate(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if not self.path.is_file():
            raise RunStoreError(f"{str(self.run_dir)!r} is not a run directory (no {DB_NAME})")

    @property
    def conn(self) -> sqlite3.Connection:
        """The raw connection, for tools outside the library (benchmarks); library code reads
        through the methods below."""
        return self._conn

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _select(
        self, cols: str, table: str, order: str, key: str, value: object
    ) -> list[sqlite3.Row]:
        """``cols`` of the rows of ``table`` in ``order``: all of them, or, when ``value`` is not
        None, those whose ``key`` is ``value``."""
        if value is None:
            return self._conn.execute(f"SELECT {cols} FROM {table} ORDER BY {order}").fetchall()
        return self._conn.execute(
            f"SELECT {cols} FROM {table} WHERE {key}=? ORDER BY {order}", (value,)
        ).fetchall()

    # -- meta --------------------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        """The JSON value kept under ``key``, its strings storable (JSON can hold a lone
        surrogate, written by another tool or an older version: see agents.llm.answers); a
        one-line RunStoreError when it is not JSON that Python reads."""
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        if row is None:
            return default
        try:
            return storable_data(json.loads(row["value"]))
        except ValueError as exc:  # not JSON, or a number past Python's int() digit limit
            raise RunStoreError(
                f"the {key!r} record of {str(self.run_dir)!r} is not readable JSON: {exc}"
            ) from None

    # -- episodes and steps ------------------------------------------------------------------
    def episode(self, episode: str) -> EpisodeRow | None:
        row = self._conn.execute("SELECT * FROM episodes WHERE episode_id=?", (episode,)).fetchone()
        return EpisodeRow(**_episode_fields(dict(row))) if row else None

    def _trial_episodes(self) -> str:
        """SQL condition: the episode is one of the trials (not an escalation run)."""
        if "escalations" not in self._added:
            return "1"
        return "episode_id NOT IN (SELECT episode_id FROM escalations)"

    def episodes(self, trial: int | None = None) -> list[EpisodeRow]:
        """Full episode rows (with prompt prefixes) of the trials, ordered by trial then game;
        escalation runs are read with :meth:`escalations`."""
        where = self._trial_episodes()
        if trial is None:
            rows = self._conn.execute(
                f"SELECT * FROM episodes WHERE {where} ORDER BY trial, game"
            ).fetchall()
        else:
            rows = self._conn.execute(
                f"SELECT * FROM episodes WHERE trial=? AND {where} ORDER BY game", (trial,)
            ).fetchall()
        return [EpisodeRow(**_episode_fields(dict(r))) for r in rows]

    def outcomes(self) -> list[Outcome]:
        """Every trial episode's outcome, ordered by trial then game (a light query: no prompts)."""
        rows = self._conn.execute(
            f"SELECT {_OUTCOME_COLUMNS} FROM episodes WHERE {self._trial_episodes()}"
            " ORDER BY trial, game"
        ).fetchall()
        return [Outcome(**_episode_fields(dict(r))) for r in rows]

    def escalations(self) -> list[Escalation]:
        """The escalation runs (unsolved tasks re-run once with another model), by game."""
        if "escalations" not in self._added:
            return []
        cols = ", ".join(f"e.{c.strip()}" for c in _OUTCOME_COLUMNS.split(","))
        rows = self._conn.execute(
            f"SELECT {cols}, x.model AS model FROM escalations x"
            " JOIN episodes e ON e.episode_id = x.episode_id ORDER BY e.game"
        ).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            model = d.pop("model")
            out.append(Escalation(Outcome(**_episode_fields(d)), model))
        return out

    def steps(self, episode: str) -> list[Step]:
        rows = self._conn.execute(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE episode_id=? ORDER BY idx",
            (episode,),
        ).fetchall()
        return [_step(r, episode) for r in rows]

    def all_steps(self) -> dict[str, list[Step]]:
        """Every episode's steps in one query (episode id -> steps in order)."""
        rows = self._conn.execute(
            f"SELECT episode_id, {', '.join(STEP_COLUMNS)} FROM steps ORDER BY episode_id, idx"
        ).fetchall()
        out: dict[str, list[Step]] = {}
        for r in rows:
            d = dict(r)
            eid = d.pop("episode_id")
            out.setdefault(eid, []).append(_step(d, eid))
        return out

    def step_counts(self) -> dict[str, StepCounts]:
        """Each episode's step counts by kind (episodes without steps are absent)."""
        rows = self._conn.execute(
            "SELECT episode_id, COUNT(*) n, SUM(kind = ?) invalid,"
            " SUM(kind = ? AND admissible = 0) inadmissible, SUM(kind = ?) think"
            " FROM steps GROUP BY episode_id",
            (StepKind.INVALID.value, StepKind.ACT.value, StepKind.THINK.value),
        ).fetchall()
        return {
            r["episode_id"]: StepCounts(
                steps=r["n"],
                invalid=r["invalid"] or 0,
                inadmissible=r["inadmissible"] or 0,
                thoughts=r["think"] or 0,
            )
            for r in rows
        }

    # -- reflections -------------------------------------------------------------------------
    def reflections(self, task: str | None = None) -> list[Reflection]:
        cols = "task, trial, episode_id, model, prompt_hash, text"
        rows = self._select(cols, "reflections", "task, trial", "task", task)
        return [Reflection(**dict(r)) for r in rows]

    def reflection_notes(self, task: str | None = None) -> list[ReflectionNote]:
        """How each memory item was made (format, truncation, critique parse errors)."""
        if "reflection_notes" not in self._added:
            return []
        cols = ", ".join(f.name for f in dataclasses.fields(ReflectionNote))
        rows = self._select(cols, "reflection_notes", "task, trial", "task", task)
        return [ReflectionNote(**dict(r)) for r in rows]

    # -- search trees ------------------------------------------------------------------------
    def search_tree(self, episode: str) -> SearchTree | None:
        """The stored search of an episode (nodes, iterations, its end), or None."""
        if "search_nodes" not in self._added:
            return None
        rows = self._conn.execute(
            f"SELECT {', '.join(_NODE_COLUMNS)} FROM search_nodes WHERE episode_id=?"
            " ORDER BY node_id",
            (episode,),
        ).fetchall()
        if not rows:
            return None
        flags = ("admissible", "terminal", "won", "chosen")
        nodes = tuple(
            SearchNode.from_dict({k: (bool(v) if k in flags else v) for k, v in dict(r).items()})
            for r in rows
        )
        its = self._conn.execute(
            f"SELECT {', '.join(_ITERATION_COLUMNS)} FROM search_iterations WHERE episode_id=?"
            " ORDER BY iteration",
            (episode,),
        ).fetchall()
        iterations = tuple(
            SearchIteration.from_dict(
                {k: (bool(v) if k == "backtrack" else v) for k, v in dict(r).items()}
            )
            for r in its
        )
        end = self._conn.execute(
            "SELECT best_node, won, reason FROM search_ends WHERE episode_id=?", (episode,)
        ).fetchone()
        return SearchTree(
            nodes,
            iterations,
            SearchEnd(end["best_node"], bool(end["won"]), end["reason"]) if end else None,
        )

    def searched_episodes(self) -> set[str]:
        """Episodes that have a stored search tree."""
        if "search_nodes" not in self._added:
            return set()
        rows = self._conn.execute("SELECT DISTINCT episode_id FROM search_nodes").fetchall()
        return {r[0] for r in rows}

    # -- compute -----------------------------------------------------------------------------
    def env_steps(self) -> dict[str, int]:
        """Env steps of each episode, replays included: a searched episode's iterations' fresh
        and replayed steps; any other episode's actions. Re-simulation after a crash or on
        resume is the harness's, not the agent's, and is not counted."""
        rows = self._conn.execute(
            "SELECT episode_id, SUM(kind = ?) n FROM steps GROUP BY episode_id",
            (StepKind.ACT.value,),
        ).fetchall()
        out = {r["episode_id"]: int(r["n"] or 0) for r in rows}
        if "search_iterations" in self._added:
            rows = self._conn.execute(
                "SELECT episode_id, SUM(env_steps + replay_steps) n FROM search_iterations"
                " GROUP BY episode_id"
            ).fetchall()
            out.update({r["episode_id"]: int(r["n"] or 0) for r in rows})
        return out

    def tokens_by_trial(self) -> dict[int, int]:
        """Prompt + completion tokens of every model call of each trial (its episodes and the
        calls between them); escalation runs are left out."""
        where = "1"
        if "escalations" in self._added:
            where = "(episode_id IS NULL OR episode_id NOT IN (SELECT episode_id FROM escalations))"
        rows = self._conn.execute(
            "SELECT trial, COALESCE(SUM(prompt_tokens + completion_tokens), 0) n"
            f" FROM model_calls WHERE {where} GROUP BY trial ORDER BY trial"
        ).fetchall()
        return {r["trial"]: int(r["n"]) for r in rows}

    def task_usage(self, game: str) -> TaskUsage:
        """Tokens and seconds ``game`` has used across its trials (per-task budgets)."""
        row = self._conn.execute(
            "SELECT (SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM model_calls"
            "  WHERE game = ?) tokens,"
            " (SELECT COALESCE(SUM(COALESCE(finished_at, ?) - started_at), 0) FROM episodes"
            "  WHERE game = ?) played,"
            " (SELECT COALESCE(SUM(latency_s), 0) FROM model_calls"
            "  WHERE game = ? AND episode_id IS NULL) between_s",
            (game, time.time(), game, game),
        ).fetchone()
        return TaskUsage(int(row["tokens"]), float(row["played"]) + float(row["between_s"]))

    # -- trials and events -------------------------------------------------------------------
    def trial_rows(self) -> list[TrialRow]:
        rows = self._conn.execute("SELECT * FROM trials ORDER BY trial").fetchall()
        return [
            TrialRow(
                trial=r["trial"],
                tasks=tuple(json.loads(r["tasks_json"])),
                started_at=r["started_at"],
                finished_at=r["finished_at"],
            )
            for r in rows
        ]

    def trials(self) -> list[dict[str, Any]]:
        """``trial_rows`` as dicts (``trial``, ``tasks``, ``started_at``, ``finished_at``)."""
        return [{**dataclasses.asdict(t), "tasks": list(t.tasks)} for t in self.trial_rows()]

    def event_rows(self, kind: str | None = None) -> list[EventRow]:
        return [EventRow(**dict(r)) for r in self._select("*", "events", "id", "kind", kind)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """``event_rows`` as dicts."""
        return [dataclasses.asdict(e) for e in self.event_rows(kind)]

    def event_counts(self) -> dict[str, int]:
        rows = self._conn.execute(
            "SELECT kind, COUNT(*) n FROM events GROUP BY kind ORDER BY kind"
        ).fetchall()
        return {r["kind"]: r["n"] for r in rows}

    # -- model calls -------------------------------------------------------------------------
    def model_calls(self, episode: str | None = None) -> list[ModelCall]:
        """Recorded model calls in the order they were made (all, or one episode's), with the
        request as sent and the answer where they were recorded (``sent`` None where not)."""
        rows = self._select(self._call_select(), "model_calls", "id", "episode_id", episode)
        return self._calls(rows)

    def episode_calls(self, episode: EpisodeRow) -> list[ModelCall]:
        """Every model call made for ``episode``: its own (act, plan, value, ...) and those of
        its task's trial between episodes (reflect, judge), in the order they were made."""
        rows = self._conn.execute(
            f"SELECT {self._call_select()} FROM model_calls WHERE episode_id=?"
            " OR (episode_id IS NULL AND game=? AND trial=?) ORDER BY id",
            (episode.episode_id, episode.game, episode.trial),
        ).fetchall()
        return self._calls(rows)

    def _call_select(self) -> str:
        present = {r[1] for r in self._conn.execute("PRAGMA table_info(model_calls)")}
        cols = ["id", *_CALL_COLUMNS.removesuffix(", created_at").split(", ")]
        cols += [c if c in present else f"NULL AS {c}" for c in SENT_COLUMNS]
        return ", ".join(cols)

    def _calls(self, rows: Sequence[sqlite3.Row]) -> list[ModelCall]:
        known: dict[int, tuple[str, str]] = {}
        out = []
        for r in rows:
            d = dict(r)
            sent = None
            if d["prompt_form"] is not None:
                text, params = self._call_request(d, known)
                sent = SentRequest.of_text(d["prompt_form"], text, json.loads(params))
            out.append(
                ModelCall(
                    **{k: d[k] for k in _CALL_COLUMNS.removesuffix(", created_at").split(", ")},
                    id=d["id"], step=d["step"], sent=sent, answer=d["answer"],
                    finish_reason=d["finish_reason"],
                    alternatives=tuple(json.loads(d["alternatives_json"] or "[]")),
                    attempt_errors=tuple(json.loads(d["attempt_errors_json"] or "[]")),
                )
            )  # fmt: skip
        return out

    def _call_request(
        self, row: Mapping[str, Any], known: dict[int, tuple[str, str]]
    ) -> tuple[str, str]:
        """A call's whole text (its base's first ``prompt_keep`` characters and its own) and
        its fields' JSON (its base's when it kept none of its own: the same)."""
        base = row["prompt_base"]
        params = row["request_json"]
        if base is None:
            text = str(row["prompt_text"])
        else:
            if base not in known:
                below = self._conn.execute(
                    "SELECT id, prompt_base, prompt_keep, prompt_text, request_json"
                    " FROM model_calls WHERE id=?",
                    (base,),
                ).fetchone()
                if below is None:
                    raise RunStoreError(
                        f"model call {row['id']} of {str(self.run_dir)!r} extends call {base},"
                        " which the store does not hold: the store was edited by hand"
                    )
                self._call_request(below, known)
            before, before_params = known[base]
            text = before[: row["prompt_keep"]] + str(row["prompt_text"])
            params = before_params if params is None else params
        known[row["id"]] = (text, params or "{}")
        return known[row["id"]]

    def episode_errors(self, episode: str | None = None) -> list[EpisodeError]:
        """The harness failures of every attempt (of ``episode``, or of all), oldest first."""
        if "episode_errors" not in self._added:
            return []
        cols = ", ".join(f.name for f in dataclasses.fields(EpisodeError))
        rows = self._select(cols, "episode_errors", "id", "episode_id", episode)
        return [EpisodeError(**dict(r)) for r in rows]

    def calls_by_purpose(self) -> dict[str, CallTotals]:
        """Model calls summed per purpose (act, reflect, judge, ...)."""
        rows = self._conn.execute("SELECT * FROM call_totals ORDER BY purpose").fetchall()
        return {
            r["purpose"]: CallTotals(
                calls=r["calls"],
                prompt=r["prompt_tokens"],
                completion=r["completion_tokens"],
                cached_prompt=r["cached_tokens"],
                latency_s=float(r["latency_s"]),
                retries=r["retries"],
                errors=r["errors"],
            )
            for r in rows
        }

    def token_totals(self) -> Tokens:
        """Tokens of every model call, all purposes."""
        row = self._conn.execute(  # no negative total, even from an old store (cost_usd)
            "SELECT MAX(COALESCE(SUM(prompt_tokens), 0), 0) p,"
            " MAX(COALESCE(SUM(completion_tokens), 0), 0) c,"
            " MAX(COALESCE(SUM(cached_tokens), 0), 0) k FROM call_totals"
        ).fetchone()
        return Tokens(row["p"], row["c"], row["k"])

    def task_ends(
        self, manifest: dict[str, Any] | None = None, trials: int | None = None
    ) -> dict[str, TaskEnd]:
        """The tasks with no trial left, and why. A store made before they were kept derives
        them from its finished episodes: a won episode, or every planned trial played (its
        oscillation stops and task budgets were not recorded, so such a task reads unfinished).
        ``manifest``: the run's, when the caller has read it already. ``trials``: the trials
        planned now, when a resume gives more than the run had: a task that ended by playing
        all of fewer has trials left."""
        if "task_ends" not in self._added:
            return self._task_ends_of_episodes(manifest or self.get_meta("manifest") or {}, trials)
        rows = self._conn.execute("SELECT game, trial, reason FROM task_ends").fetchall()
        ends = {
            r["game"]: (r["trial"], _enum(TaskEnd, r["reason"], f"task {r['game']!r}"))
            for r in rows
        }
        return {
            game: reason
            for game, (trial, reason) in ends.items()
            if trials is None or reason is not TaskEnd.TRIALS or trial >= trials - 1
        }

    def _task_ends_of_episodes(
        self, manifest: dict[str, Any], trials: int | None
    ) -> dict[str, TaskEnd]:
        if trials is None:
            trials = (manifest.get("config") or {}).get("trials")
        rows = self._conn.execute(
            "SELECT game, MAX(won) won, COUNT(*) played FROM episodes WHERE status=? GROUP BY game",
            (EpisodeStatus.DONE.value,),
        ).fetchall()
        ends = {r["game"]: TaskEnd.SOLVED for r in rows if r["won"]}
        if isinstance(trials, int):
            ends |= {
                r["game"]: TaskEnd.TRIALS for r in rows if not r["won"] and r["played"] >= trials
            }
        return ends

    def run_state(self, trials: int | None = None) -> RunState:
        """The run's status, derived: complete when every game of the manifest has a task end;
        else running (a live process holds its lock), else how its last process ended: a budget
        stop, an interrupt, or a finished pass that left tasks to infrastructure errors (a
        process that could not say, kill -9, reads as interrupted). ``trials``: the status under
        that many trials (a resume's), see :meth:`task_ends`."""
        manifest = self.get_meta("manifest")
        games = set((manifest or {}).get("games") or {})
        finished = len(games & set(self.task_ends(manifest, trials)))
        errors = self._conn.execute(
            "SELECT COUNT(*) FROM episodes WHERE status=?", (EpisodeStatus.ERROR.value,)
        ).fetchone()[0]
        marks = "(" + ", ".join("?" * len(SESSION_EVENTS)) + ")"
        last = self._conn.execute(
            f"SELECT kind, detail FROM events WHERE kind IN {marks} AND episode_id IS NULL"
            " ORDER BY id DESC LIMIT 1",
            SESSION_EVENTS,
        ).fetchone()
        end = json.loads(last["detail"]) if last is not None and last["kind"] == "end" else {}
        how, stopped = end.get("how"), end.get("reason") if end.get("how") == "stopped" else None
        if manifest is not None and finished == len(games):
            status = RunStatus.COMPLETE
        elif holder_alive(self.run_dir, LOCK_NAME):
            status = RunStatus.RUNNING
        else:
            status = ENDED_STATUS.get(str(how), RunStatus.INTERRUPTED)
        return RunState(status, len(games), finished, int(errors), stopped, how)

    def progress(self) -> Progress:
        """Solved tasks and tokens so far, from an index and the running totals (cheap)."""
        row = self._conn.execute(
            "SELECT (SELECT COUNT(DISTINCT game) FROM episodes WHERE won = 1) solved,"
            " (SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM call_totals) tokens"
        ).fetchone()
        return Progress(solved=row["solved"], tokens=row["tokens"])


def open_reader(run_dir: str | Path, *, check: bool | None = None) -> RunReader:
    """The run's store, read-only; a one-line RunStoreError when it cannot be read (checked
    for damage on open unless ``check`` is False; None: when the file is small)."""
    return RunReader(run_dir, check=check)


class RunStore(RunReader):
    """Read/write access to one run's database. Writes are committed immediately.

    ``readonly=True`` opens it like ``RunReader`` (the write methods then fail).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        create: bool = False,
        readonly: bool = False,
        check: bool = True,
    ) -> None:
        """``check``: ``PRAGMA quick_check`` an existing store first (off only where the caller
        checked it under the run's lock a moment ago)."""
        if readonly:
            super().__init__(run_dir, check=None if check else False)
            return
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if create:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunStoreError(
                    f"cannot create run dir {str(self.run_dir)!r}: {exc.strerror}"
                ) from None
        else:
            self._locate(run_dir)
        existing = self.path.is_file() and self.path.stat().st_size > 0
        self._conn = _connect(self.path, readonly=False)
        try:
            with _opening(self._conn, self.run_dir):
                if existing and check:
                    _quick_check(self._conn)  # never play on into a damaged store
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                with self.transaction():
                    self._upgrade()
        except StoreFullError:
            if existing:
                raise
            for suffix in ("", "-wal", "-shm"):  # the new store never held a thing: no trace
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            raise StoreFullError(
                f"the disk holding {str(self.path)!r} is full: nothing was recorded; free space,"
                " then run it again"
            ) from None
        self._conn.row_factory = sqlite3.Row
        self._added = frozenset(_ADDED_NAMES)
        # per episode (or task trial), the last text of each purpose and form: (row id, text)
        self._recent: dict[str, dict[str, tuple[int, str, str]]] = {}

    def _upgrade(self) -> None:
        """Create a new store, or migrate an older one to the current version (in a transaction)."""
        found = _stored_version(self._conn, self.run_dir)
        if found is None:
            for statement in (*_TABLES_V1, *_TABLES_V2):
                self._conn.execute(statement)
        else:
            for version in range(found, SCHEMA_VERSION):
                _MIGRATIONS[version](self._conn)
        for statement in _TABLES_ADDED:
            self._conn.execute(statement)
        for table, column, declaration in _COLUMNS_ADDED:
            present = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES ('schema_version', ?)"
            " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (str(SCHEMA_VERSION),),
        )
        self.schema_version = SCHEMA_VERSION

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- meta / manifest ---------------------------------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value, sort_keys=True)),
        )

    # -- episodes and steps ------------------------------------------------------------------
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
        seed: int | None = None,
        experience: Mapping[str, Any] | None = None,
    ) -> None:
        """``experience``: the experience of other games the prompt shows (None: none given)."""
        self._conn.execute(
            "INSERT INTO episodes(episode_id, game, task_type, trial, arm, status, prompt_prefix,"
            " observation, task, memory_json, started_at, seed, experience_json)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                episode_id, game, task_type, trial, arm, EpisodeStatus.RUNNING.value,
                prompt_prefix, observation, task, json.dumps([r.to_dict() for r in memory]),
                time.time(), seed,
                json.dumps(experience, sort_keys=True) if experience is not None else None,
            ),
        )  # fmt: skip

    def add_step(self, episode: str, step: Step) -> None:
        """Record a step (its tokens stay on the step for the viewer; the model call that made
        it is recorded separately with ``add_model_call``)."""
        values = [step.index, StepKind(step.kind).value]
        values += [getattr(step, c) for c in STEP_COLUMNS[2:]]
        self._conn.execute(
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
        """``status`` is an EpisodeStatus value and ``failure_class`` a FailureClass value."""
        failure = FailureClass(failure_class).value if failure_class is not None else None
        self._conn.execute(
            "UPDATE episodes SET status=?, won=?, failure_class=?, verdict=?, error=?, finished_at=?"
            " WHERE episode_id=?",
            (EpisodeStatus(status).value, int(won), failure, verdict, error, time.time(), episode),
        )

    def add_episode_error(self, episode: str, kind: str, error: str, traceback: str) -> None:
        """Keep why the episode's current attempt failed (a retry forgets its row's error)."""
        self._conn.execute(
            "INSERT INTO episode_errors(episode_id, attempt, kind, error, traceback, created_at)"
            " SELECT episode_id, attempts, ?, ?, ?, ? FROM episodes WHERE episode_id=?",
            (kind, error, traceback, time.time(), episode),
        )

    def set_judge(self, episode: str, verdict: str, reason: str) -> None:
        self._conn.execute(
            "UPDATE episodes SET judge_verdict=?, judge_reason=? WHERE episode_id=?",
            (verdict, reason, episode),
        )

    def mark_resimulated(self, episode: str) -> None:
        self._conn.execute(
            "UPDATE episodes SET resimulated = resimulated + 1 WHERE episode_id=?", (episode,)
        )

    def mark_interrupted(self) -> int:
        """Episodes left in play by an interrupt: ``interrupted`` (a resume continues them from
        their last recorded step). Returns how many."""
        cur = self._conn.execute(
            "UPDATE episodes SET status=? WHERE status=?",
            (EpisodeStatus.INTERRUPTED.value, EpisodeStatus.RUNNING.value),
        )
        return int(cur.rowcount)

    def continue_episode(self, episode: str) -> None:
        """An interrupted episode is in play again."""
        self._conn.execute(
            "UPDATE episodes SET status=? WHERE episode_id=? AND status=?",
            (EpisodeStatus.RUNNING.value, episode, EpisodeStatus.INTERRUPTED.value),
        )

    def retry_episode(self, episode: str) -> None:
        """Forget an errored episode's steps so it is played again from the start.

        Its model calls stay recorded: they were made, and budgets count them.
        """
        with self.transaction():
            self._conn.execute("DELETE FROM steps WHERE episode_id=?", (episode,))
            self._forget_search(episode)
            self._conn.execute(
                "UPDATE episodes SET status=?, won=0, failure_class=NULL, verdict=NULL,"
                " error=NULL, finished_at=NULL, attempts=attempts+1 WHERE episode_id=?",
                (EpisodeStatus.RUNNING.value, episode),
            )

    def _forget_search(self, episode: str) -> None:
        for table in ("search_nodes", "search_iterations", "search_ends"):
            self._conn.execute(f"DELETE FROM {table} WHERE episode_id=?", (episode,))

    def set_failure_class(self, episode: str, failure_class: str, verdict: str) -> None:
        """Re-class a finished, failed episode (the oscillation stop: ``oscillating``)."""
        self._conn.execute(
            "UPDATE episodes SET failure_class=?, verdict=? WHERE episode_id=? AND won=0",
            (FailureClass(failure_class).value, verdict, episode),
        )

    def mark_escalation(self, episode: str, game: str, model: str) -> None:
        """``episode`` is the escalation run of ``game`` with ``model`` (before it starts)."""
        self._conn.execute(
            "INSERT OR IGNORE INTO escalations(episode_id, game, model, created_at)"
            " VALUES (?,?,?,?)",
            (episode, game, model, time.time()),
        )

    # -- search trees ------------------------------------------------------------------------
    def save_search(
        self, episode: str, nodes: Sequence[SearchNode], iteration: SearchIteration | None = None
    ) -> None:
        """Insert or update ``nodes`` and record ``iteration``, in one transaction (an
        iteration is the unit a resumed search continues from)."""
        cols = ", ".join(_NODE_COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in _NODE_COLUMNS if c != "node_id")
        with self.transaction():
            self._conn.executemany(
                f"INSERT INTO search_nodes(episode_id, {cols})"
                f" VALUES (?, {', '.join('?' * len(_NODE_COLUMNS))})"
                f" ON CONFLICT(episode_id, node_id) DO UPDATE SET {updates}",
                [(episode, *(getattr(n, c) for c in _NODE_COLUMNS)) for n in nodes],
            )
            if iteration is not None:
                self._conn.execute(
                    f"INSERT OR REPLACE INTO search_iterations(episode_id,"
                    f" {', '.join(_ITERATION_COLUMNS)}, created_at)"
                    f" VALUES (?, {', '.join('?' * len(_ITERATION_COLUMNS))}, ?)",
                    (episode, *(getattr(iteration, c) for c in _ITERATION_COLUMNS), time.time()),
                )

    def end_search(self, episode: str, end: SearchEnd, chosen: Sequence[int]) -> None:
        """The search ended: ``chosen`` (node ids, root first) is the path written as steps."""
        with self.transaction():
            self._conn.executemany(
                "UPDATE search_nodes SET chosen=1 WHERE episode_id=? AND node_id=?",
                [(episode, n) for n in chosen],
            )
            self._conn.execute(
                "INSERT OR REPLACE INTO search_ends(episode_id, best_node, won, reason, created_at)"
                " VALUES (?,?,?,?,?)",
                (episode, end.best_node, int(end.won), end.reason, time.time()),
            )

    # -- model calls and reflections ---------------------------------------------------------
    def add_model_call(self, call: ModelCall) -> None:
        """Record one model call of any purpose (act, reflect, judge, plan, value, ...), with
        its request as sent and its answer.

        Prompts are append-only, so a call's text (:attr:`SentRequest.text`) is kept as what it
        adds to the longest leading part it shares with the last call of each purpose of the
        same episode (a reflect or judge call: of the same task and trial): a step's prompt
        costs the store the step's new text, not the whole prompt; a text that shares fewer
        than ``MIN_SHARED_CHARS`` characters is kept whole. The other fields sent (sampling,
        stop, seed, ...) are kept only where they differ from that call's."""
        sent = call.sent
        base = keep = form = text = params = kept = None
        if sent is not None:
            form, text = sent.form, sent.text
            params = json.dumps(sent.params, sort_keys=True, ensure_ascii=False)
            base, keep, same = self._shared_with(call, form, text, params)
            kept = None if same else params  # the base's fields: not kept twice
        cur = self._conn.execute(
            f"INSERT INTO model_calls({_CALL_COLUMNS}, {', '.join(SENT_COLUMNS)})"
            f" VALUES ({', '.join('?' * (11 + len(SENT_COLUMNS)))})",
            (
                call.purpose, call.game, call.trial, call.episode_id, call.prompt_tokens,
                call.completion_tokens, call.cached_tokens, call.latency_s, call.retries,
                call.error, time.time(), call.step, form, base, keep,
                None if text is None else text[keep or 0 :], kept, call.answer,
                call.finish_reason, _json_list(call.alternatives),
                _json_list(call.attempt_errors),
            ),
        )  # fmt: skip
        if text is not None and params is not None and cur.lastrowid is not None:
            key = call.episode_id or f"{call.game}#t{call.trial}"
            recent = self._recent.pop(key, {})
            recent[f"{call.purpose}:{form}"] = (cur.lastrowid, text, params)
            self._recent[key] = recent  # the newest last
            while len(self._recent) > _RECENT_KEYS:
                del self._recent[next(iter(self._recent))]

    def _shared_with(
        self, call: ModelCall, form: str, text: str, params: str
    ) -> tuple[int | None, int | None, bool]:
        """The recent call of the same episode and form whose text shares the longest leading
        part with ``text``, that part's length, and whether its fields are ``params``; (None,
        None, False) when none shares enough."""
        best: tuple[int | None, int | None, bool] = (None, None, False)
        longest = MIN_SHARED_CHARS - 1
        key = call.episode_id or f"{call.game}#t{call.trial}"
        for name, (row, earlier, fields) in self._recent.get(key, {}).items():
            if not name.endswith(f":{form}"):
                continue
            shared = shared_prefix(earlier, text)
            if shared > longest:
                best, longest = (row, shared, fields == params), shared
        return best

    def add_reflection(
        self, r: Reflection, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        """Record a reflection (its tokens are shown with it; the reflect call that wrote it is
        recorded separately with ``add_model_call``)."""
        self._conn.execute(
            "INSERT OR IGNORE INTO reflections(task, trial, episode_id, model, prompt_hash, text,"
            " prompt_tokens, completion_tokens, created_at) VALUES (?,?,?,?,?,?,?,?,?)",
            (r.task, r.trial, r.episode_id, r.model, r.prompt_hash, r.text, prompt_tokens,
             completion_tokens, time.time()),
        )  # fmt: skip

    def add_reflection_note(self, note: ReflectionNote) -> None:
        """How the memory item of (task, trial) was made (see ``reflection_notes``)."""
        cols = [f.name for f in dataclasses.fields(ReflectionNote)]
        self._conn.execute(
            f"INSERT OR IGNORE INTO reflection_notes({', '.join(cols)})"
            f" VALUES ({', '.join('?' * len(cols))})",
            tuple(getattr(note, c) for c in cols),
        )

    # -- trials and events -------------------------------------------------------------------
    def start_trial(self, trial: int, tasks: Sequence[str]) -> None:
        self._conn.execute(
            "INSERT OR IGNORE INTO trials(trial, tasks_json, started_at) VALUES (?,?,?)",
            (trial, json.dumps(list(tasks)), time.time()),
        )

    def join_trial(self, trial: int, game: str) -> None:
        """Record that ``game`` runs in trial ``trial`` (tasks advance through trials on their
        own, so a trial's task list grows as its tasks reach it)."""
        with self.transaction():
            row = self._conn.execute(
                "SELECT tasks_json FROM trials WHERE trial=?", (trial,)
            ).fetchone()
            if row is None:
                self._conn.execute(
                    "INSERT INTO trials(trial, tasks_json, started_at) VALUES (?,?,?)",
                    (trial, json.dumps([game]), time.time()),
                )
                return
            tasks = json.loads(row["tasks_json"])
            if game not in tasks:
                self._conn.execute(
                    "UPDATE trials SET tasks_json=? WHERE trial=?",
                    (json.dumps(sorted([*tasks, game])), trial),
                )

    def reopen_tasks(self) -> None:
        """Forget every task end: a new pass of the trial loop records each again under its
        plan (a resume may allow more trials than the last)."""
        self._conn.execute("DELETE FROM task_ends")

    def end_task(self, game: str, trial: int, reason: str) -> None:
        """``game`` has no trial left (``reason``: a TaskEnd value), recorded as it happens."""
        self._conn.execute(
            "INSERT INTO task_ends(game, trial, reason, created_at) VALUES (?,?,?,?)"
            " ON CONFLICT(game) DO UPDATE SET trial=excluded.trial, reason=excluded.reason,"
            " created_at=excluded.created_at",
            (game, trial, TaskEnd(reason).value, time.time()),
        )

    def finish_trial(self, trial: int) -> None:
        self._conn.execute("UPDATE trials SET finished_at=? WHERE trial=?", (time.time(), trial))

    def log_event(self, kind: str, detail: str, episode: str | None = None) -> None:
        self._conn.execute(
            "INSERT INTO events(ts, kind, episode_id, detail) VALUES (?,?,?,?)",
            (time.time(), kind, episode, detail),
        )
