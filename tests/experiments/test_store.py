"""The run store: typed reads with enums, every model call counted, schema versions (a real v1
store migrated in place or read as it is; newer or unversioned stores refused), and all SQL in
one module."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.errors import RunStoreError
from experiments.store import (
    DB_NAME,
    SCHEMA_VERSION,
    CallTotals,
    Progress,
    RunReader,
    RunStore,
    StepCounts,
    Tokens,
    episode_id,
    open_reader,
)
from memory.records import EpisodeStatus, FailureClass, ModelCall, SentRequest, Step, StepKind
from tests.support.runfactory import COMMITTED, COMMITTED_V1, game_id, make_run, standard_tasks

ROOT = Path(__file__).resolve().parent.parent.parent
needs_committed = pytest.mark.skipif(not COMMITTED, reason="no committed results in this checkout")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sql(run_dir: Path, statement: str, *args: object) -> list[tuple]:
    conn = sqlite3.connect(run_dir / DB_NAME, isolation_level=None)
    try:
        return conn.execute(statement, args).fetchall()
    finally:
        conn.close()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run", standard_tasks())


@pytest.fixture
def v1_copy(tmp_path: Path) -> Path:
    """The smallest committed run written by version 1, copied (never opened in place: a
    reader of a WAL store would leave its -wal and -shm files beside it)."""
    if not COMMITTED_V1:
        pytest.skip("no committed version-1 results in this checkout")
    source = min(COMMITTED_V1, key=lambda d: (d / DB_NAME).stat().st_size)
    copy = tmp_path / "v1"
    copy.mkdir()
    shutil.copy(source / DB_NAME, copy / DB_NAME)
    return copy


# -- typed reads ---------------------------------------------------------------------------------
def test_a_new_store_has_the_current_version(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "new", create=True)
    assert store.schema_version == SCHEMA_VERSION == 2
    store.close()
    assert sql(tmp_path / "new", "SELECT value FROM meta WHERE key='schema_version'") == [("2",)]
    with open_reader(tmp_path / "new") as reader:
        assert reader.schema_version == 2 and reader.token_totals() == Tokens(0, 0, 0)
        assert reader.progress() == Progress(solved=0, tokens=0)


def test_status_kind_and_failure_class_are_enums(run: Path) -> None:
    with open_reader(run) as reader:
        episodes = reader.episodes()
        assert all(isinstance(e.status, EpisodeStatus) for e in episodes)
        heat = reader.episode(episode_id(game_id("heat", 3), 0))
        assert heat is not None and heat.status is EpisodeStatus.ERROR
        assert heat.failure_class is FailureClass.INFRA_ERROR
        cool = [o for o in reader.outcomes() if o.game == game_id("cool", 4)]
        assert [o.failure_class for o in cool] == [
            FailureClass.INVALID_ACTIONS, FailureClass.TOO_LONG, FailureClass.REPEATED_ACTION,
        ]  # fmt: skip
        steps = reader.steps(cool[0].episode_id)
        assert [s.kind for s in steps] == [
            StepKind.THINK, StepKind.ACT, StepKind.INVALID, StepKind.ACT, StepKind.ACT,
        ]  # fmt: skip
        assert all(isinstance(s.kind, StepKind) for s in steps)
        assert reader.all_steps()[cool[0].episode_id] == steps
        assert reader.step_counts()[cool[0].episode_id] == StepCounts(
            steps=5, invalid=1, inadmissible=1, thoughts=1
        )
        assert [len(t.tasks) for t in reader.trial_rows()] == [4, 3, 2]
        assert [t["tasks"] for t in reader.trials()] == [list(t.tasks) for t in reader.trial_rows()]
        assert reader.event_counts() == {"infra_error": 1}
        assert reader.events("infra_error")[0]["episode_id"] == heat.episode_id


def test_the_writer_takes_only_known_statuses_and_kinds(run: Path) -> None:
    store = RunStore(run)
    eid = episode_id(game_id("put", 1), 0)
    try:
        with pytest.raises(ValueError, match="'finished' is not a valid EpisodeStatus"):
            store.finish_episode(eid, status="finished", won=True)
        with pytest.raises(ValueError, match="is not a valid FailureClass"):
            store.finish_episode(eid, status="done", won=False, failure_class="bored")
        with pytest.raises(ValueError, match="is not a valid StepKind"):
            store.add_step(
                eid, Step(index=9, kind="dance", raw_output="", action="", observation="")
            )
    finally:
        store.close()


def test_an_unknown_status_in_the_file_is_a_one_line_error(run: Path) -> None:
    sql(run, "UPDATE episodes SET status='paused' WHERE trial=0")
    with open_reader(run) as reader, pytest.raises(RunStoreError) as err:
        reader.outcomes()
    assert "unknown EpisodeStatus 'paused'" in str(err.value) and "\n" not in str(err.value)


# -- model calls ---------------------------------------------------------------------------------
def test_every_model_call_counts_whatever_its_purpose(run: Path) -> None:
    game = game_id("cool", 4)
    eid = episode_id(game, 2)
    calls = [
        ModelCall("act", game, 2, eid, 100, 5, 80, 0.25),
        ModelCall("act", game, 2, eid, 120, 6, 100, 0.5, retries=2),
        ModelCall("judge", game, 2, eid, 70, 3, 0, 0.1),
        ModelCall("reflect", game, 2, eid, 50, 20, 10, 1.0),
        ModelCall("plan", game, 2, None, 40, 0, 0, 2.0, retries=3, error="timeout"),
    ]
    store = RunStore(run)
    try:
        before = store.steps(eid)
        for call in calls:
            store.add_model_call(call)
        assert store.steps(eid) == before  # calls and steps are separate records
        store.retry_episode(eid)  # its steps go; its calls were made and stay counted
    finally:
        store.close()
    with open_reader(run) as reader:
        assert reader.model_calls() == calls
        assert reader.model_calls(eid) == calls[:4]
        assert reader.token_totals() == Tokens(prompt=380, completion=34, cached_prompt=190)
        by_purpose = reader.calls_by_purpose()
        assert by_purpose == {
            "act": CallTotals(calls=2, prompt=220, completion=11, cached_prompt=180,
                              latency_s=0.75, retries=2, errors=0),
            "judge": CallTotals(calls=1, prompt=70, completion=3, cached_prompt=0,
                                latency_s=0.1, retries=0, errors=0),
            "plan": CallTotals(calls=1, prompt=40, completion=0, cached_prompt=0,
                               latency_s=2.0, retries=3, errors=1),
            "reflect": CallTotals(calls=1, prompt=50, completion=20, cached_prompt=10,
                                  latency_s=1.0, retries=0, errors=0),
        }  # fmt: skip
        # the running totals agree with the rows they sum
        assert sql(run, "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM model_calls") == [
            (380, 34)
        ]
        solved = len({e.game for e in reader.episodes() if e.won})
        assert reader.progress() == Progress(solved=solved, tokens=414) and solved == 3


def test_each_call_is_kept_as_sent_and_a_prompt_as_what_it_adds(run: Path) -> None:
    """A call's request comes back exactly as it was recorded; a step's prompt costs the store
    its new text (the part it shares with the episode's last prompt is a reference), a text
    that is no extension (the code protocol's ``obs>`` then ``obs\n> act``) keeps the shared
    part, and chat messages are kept the same way."""
    game = game_id("cool", 4)
    eid = episode_id(game, 2)
    prefix = "Interact with a household to solve a task. " * 20
    prompts = [prefix + "You see a desk 1.>"]
    for k in range(1, 6):
        prompts.append(prompts[-1][:-1] + f"\n> go to desk {k}\nYou arrive at desk {k}.>")
    sampling = {"temperature": 0.0, "stop": ["\n"], "seed": 7}
    calls = [
        ModelCall("act", game, 2, eid, step=k, answer=f" go to desk {k + 1}", finish_reason="stop",
                  sent=SentRequest(prompt=p, params=sampling))
        for k, p in enumerate(prompts)
    ]  # fmt: skip
    chat = [(("user", "Continue.\n\n" + p),) for p in prompts[:3]]
    calls += [
        ModelCall("act", game, 2, eid, step=k, sent=SentRequest(messages=m), answer=" look")
        for k, m in enumerate(chat)
    ]
    calls.append(
        ModelCall("reflect", game, 2, None, retries=2, attempt_errors=("HTTP 503", "timeout"),
                  sent=SentRequest(prompt="Reflect.\n" + prompts[-1]), answer="Plan: x",
                  alternatives=("Plan: y",))
    )  # fmt: skip
    with RunStore(run) as store:
        for call in calls:
            store.add_model_call(call)
    rows = sql(run, "SELECT prompt_base, prompt_keep, length(prompt_text) FROM model_calls"
               " WHERE prompt_form IS NOT NULL ORDER BY id")  # fmt: skip
    assert rows[0] == (None, None, len(prompts[0]))  # the first prompt is whole
    for k in range(1, 6):  # then what each adds after the shared part (all but the '>')
        base, keep, added = rows[k]
        assert keep == len(prompts[k - 1]) - 1 and added == len(prompts[k]) - keep
    assert rows[6][0] is None  # the first messages: whole (no text is shared across forms)
    assert all(r[0] is not None and r[2] < 200 for r in rows[7:9])  # then what they add
    with open_reader(run) as reader:
        got = [c for c in reader.model_calls() if c.sent is not None]
        assert got == calls
        assert [c.sent.prompt for c in got[:6]] == prompts
        row = reader.episode(eid)
        assert row is not None
        mine = reader.episode_calls(row)  # its own calls and its trial's reflection
        assert [c for c in mine if c.sent is not None] == calls


# -- schema versions -----------------------------------------------------------------------------
@needs_committed
def test_a_v1_store_is_read_as_it_is_without_writing(v1_copy: Path) -> None:
    before = sha(v1_copy / DB_NAME)
    (steps, sp, sc, sk), = sql(v1_copy, "SELECT COUNT(*), SUM(prompt_tokens),"
                              " SUM(completion_tokens), SUM(cached_tokens) FROM steps")  # fmt: skip
    (refl, rp, rc), = sql(v1_copy, "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0),"
                          " COALESCE(SUM(completion_tokens), 0) FROM reflections")  # fmt: skip
    before_names = {p.name for p in v1_copy.iterdir()}
    with open_reader(v1_copy) as reader:
        assert reader.schema_version == 1
        # version 1 counted step and reflection tokens: the same totals, now by purpose
        assert reader.token_totals() == Tokens(sp + rp, sc + rc, sk)
        by_purpose = reader.calls_by_purpose()
        assert by_purpose["act"].calls == steps and by_purpose["act"].prompt == sp
        assert by_purpose.get("reflect", CallTotals(0, 0, 0, 0, 0.0, 0, 0)).calls == refl
        calls = reader.model_calls()
        assert len(calls) == steps + refl and {c.purpose for c in calls} <= {"act", "reflect"}
        assert all(c.sent is None and c.answer is None for c in calls)  # none was recorded
    with RunStore(v1_copy, readonly=True) as store:  # the old read-only spelling works too
        assert store.schema_version == 1 and store.token_totals().prompt == sp + rp
    assert sha(v1_copy / DB_NAME) == before and {p.name for p in v1_copy.iterdir()} == before_names


@needs_committed
def test_a_v1_store_opened_for_writing_is_migrated_once(v1_copy: Path) -> None:
    with open_reader(v1_copy) as reader:
        viewed = (reader.model_calls(), reader.calls_by_purpose(), reader.token_totals())
        outcomes = reader.outcomes()
    store = RunStore(v1_copy)
    assert store.schema_version == 2
    store.close()
    assert sql(v1_copy, "SELECT value FROM meta WHERE key='schema_version'") == [("2",)]
    with open_reader(v1_copy) as reader:
        assert reader.schema_version == 2
        # the backfilled rows are exactly what the read-only view showed
        assert (reader.model_calls(), reader.calls_by_purpose(), reader.token_totals()) == viewed
        assert reader.outcomes() == outcomes
        (event,) = reader.event_rows("migrate")
        assert json.loads(event.detail) == {"from": 1, "to": 2, "model_calls": len(viewed[0])}
    store = RunStore(v1_copy)  # already current: nothing happens again
    game = outcomes[0].game
    store.add_model_call(ModelCall("judge", game, 0, outcomes[0].episode_id, 7, 1))
    store.close()
    with open_reader(v1_copy) as reader:
        assert len(reader.event_rows("migrate")) == 1
        assert reader.token_totals().prompt == viewed[2].prompt + 7


def test_a_newer_store_is_refused_untouched(run: Path) -> None:
    sql(run, "UPDATE meta SET value='3' WHERE key='schema_version'")
    before = sha(run / DB_NAME)
    for opener in (RunStore, RunReader, open_reader, lambda d: RunStore(d, readonly=True)):
        with pytest.raises(RunStoreError) as err:
            opener(run)
        message = str(err.value)
        assert "schema version 3, newer than this reflexsim reads (2)" in message
        assert "upgrade reflexsim" in message and "\n" not in message
    assert sha(run / DB_NAME) == before
    r = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "report", str(run)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("reflexsim: error: ") and r.stderr.count("\n") == 1
    assert "upgrade reflexsim" in r.stderr


def test_a_store_without_a_version_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    sql(other, "CREATE TABLE notes (text TEXT)")
    for opener in (RunStore, open_reader):
        with pytest.raises(RunStoreError, match="has no schema version: it is not a reflexsim"):
            opener(other)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / DB_NAME).write_bytes(b"not a database at all" * 100)
    for opener in (RunStore, open_reader):
        with pytest.raises(RunStoreError, match="cannot read the run store"):
            opener(garbage)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / DB_NAME).touch()
    with pytest.raises(RunStoreError, match="is not a run directory"):
        open_reader(empty)


# -- one read layer ------------------------------------------------------------------------------
SQL_HOME = {"experiments/store.py", "agents/llm/scripted.py"}  # scripted: replays a recorded run
DB_API = {"execute", "executemany", "executescript"}


def test_all_sql_lives_in_the_store_module() -> None:
    offenders = []
    for package in ("agents", "envs", "memory", "experiments"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in SQL_HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and (
                    node.attr in DB_API
                    or (node.attr == "connect" and ast.unparse(node.value) == "sqlite3")
                    or (node.attr == "conn" and package == "experiments")  # a store's connection
                ):
                    offenders.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []
