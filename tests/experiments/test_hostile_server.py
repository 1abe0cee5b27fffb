"""A misbehaving OpenAI-compatible server on loopback (tests/support/fault_server.py) drives a
Reflexion run, an ``insights`` run and ``reflexsim extract`` through the command line, as a
user would: odd text (lone surrogates, control characters, a 10 MB answer, garbage) is taken
and the command exits 0; broken answers (a 500, bad usage counts, malformed JSON, no choices,
a body cut mid-way) are retried, then end as infrastructure errors: exit 3, one line (README
"Exit codes"). ``report`` and ``export`` work on what is left, the same work against a
well-behaved server finishes it, and no traceback is printed anywhere. Also: a token budget
holds, a report reads any store, and another run's kept rules are checked when read."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.llm.markers import TASK_TYPE_LINE
from agents.llm.scripted import insights_answer
from experiments.cli import main
from experiments.experience import INSIGHTS_KEY, extract_rules
from experiments.report import write_report
from experiments.session import run
from experiments.store import RunReader, RunStore
from memory.records import ModelCall
from tests.support.fault_server import BROKEN_ANSWERS, ODD_ANSWERS, FaultPlan, FaultServer
from tests.support.gameruns import SPLIT, game_run
from tests.support.runfactory import make_run, standard_tasks

ROOT = Path(__file__).resolve().parents[2]
BROKEN = ("500", "malformed", *BROKEN_ANSWERS)  # server faults: retried, then the request's error
FAST = [
    "--backend-option", "max_retries=1", "--backend-option", "backoff_base=0.01",
    "--backend-option", "jitter=0", "--backend-option", "timeout=20",
]  # fmt: skip
HEAT = ["--task-types", "heat"]  # one game: the scripted learner fails, then wins


def answer(prompt: str) -> str:
    """A server's model: rule extraction answers as the scripted policies do, the rest looks."""
    return insights_answer(prompt) if TASK_TYPE_LINE in prompt else " look"


def reflexsim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "experiments.cli", *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> int:
    """``reflexsim ARGS`` in this process: its exit code (no traceback: main would raise)."""
    code = main(list(args))
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return code


@pytest.fixture(scope="module")
def gathered(train_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished gathering run (the scripted learner on a heat game: a failed and a won trial),
    its rules not extracted."""
    run = tmp_path_factory.mktemp("gathered") / "gather"
    r = reflexsim(
        "run", "--agent", "reflexion", "--model", "scripted:learner", "--data", str(train_games),
        "--split", "train", *HEAT, "--trials", "2", "--max-steps", "8", "--run-dir", str(run),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture
def source(gathered: Path, tmp_path: Path) -> Path:
    """A copy of the gathering run (extraction writes its rules into it)."""
    return Path(shutil.copytree(gathered, tmp_path / "gather"))


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[FaultServer]:
    """The server misbehaving as the test's ``kind`` on every answer."""
    kind = request.node.callspec.params["kind"]
    with FaultServer(FaultPlan(rate=1.0, kinds=(kind,)), answer=answer) as s:
        yield s


def driver_args(driver: str, games: Path, source: Path, run: Path, url: str) -> list[str]:
    if driver == "extract":
        return ["extract", str(source), "--model", "openai:t", "--base-url", url, *FAST]
    common = ["--model", "openai:t", "--base-url", url, "--data", str(games), "--split", SPLIT]
    if driver == "insights":
        arm = ["--agent", "insights", "--experience-from", str(source), "--trials", "1"]
    else:
        arm = ["--agent", "reflexion", "--trials", "2"]
    return ["run", *arm, *common, *HEAT, "--max-steps", "2", "--run-dir", str(run), *FAST]


DRIVERS = ("reflexion", "insights", "extract")
# odd text reaches each command's own use of it (a reflection, a rule, a rating): every kind
# through every command. A broken answer is retried, then ends the request as an infrastructure
# error, the same way whichever of them it is (tests/agents/llm/test_answers.py checks each kind
# at the client, through every API); here each kind goes through one command, in turn, so that
# every command meets several of them
CASES = [(driver, kind) for kind in ODD_ANSWERS for driver in DRIVERS] + [
    (DRIVERS[i % len(DRIVERS)], kind) for i, kind in enumerate(BROKEN)
]


@pytest.mark.parametrize(("driver", "kind"), CASES)
def test_a_misbehaving_server_never_crashes_a_command(
    driver: str,
    kind: str,
    server: FaultServer,
    generated_games: Path,
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    args = driver_args(driver, generated_games, source, run, server.url)
    r = reflexsim(*args)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert "\x1b" not in r.stderr + r.stdout and "\x00" not in r.stderr + r.stdout
    broken = kind in BROKEN
    assert r.returncode == (3 if broken else 0), (r.returncode, r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("reflexsim: error:")]
    if broken and driver != "reflexion":  # no episode played: one line says so
        assert len(errors) == 1 and "rule extraction" in errors[0], r.stderr[-3000:]
        assert "run the command again" in errors[0]
    else:
        assert not errors, errors
    result = source if driver == "extract" else run
    stored = (result / "run.sqlite").is_file()
    assert stored == (not broken or driver != "insights")  # a failed extract phase plays nothing
    if stored:
        with RunReader(result) as store:
            counts = store.event_counts()
            reflections = [r.text for r in store.reflections()]
        if driver == "reflexion" and kind == "surrogate":  # a reflection's text too
            assert reflections and all("\ufffd" in text for text in reflections)
        expected = {"surrogate": "invalid_text", "huge": "oversized"}.get(kind)
        if broken:
            expected = "infra_error"
        assert driver == "extract" or expected is None or counts.get(expected), counts
        assert in_process(capsys, "report", str(result)) == 0
        assert in_process(capsys, "export", str(result), "--format", "csv") == 0
    # the same work against a well-behaved server at the same address finishes it
    port = server.port
    server.stop()
    with FaultServer(answer=answer, port=port):
        if driver == "extract" or not stored:
            assert in_process(capsys, *args) == 0
        else:
            assert in_process(capsys, "run", "--resume", str(run)) == 0
    with RunReader(result) as store:
        assert store.run_state().complete
    if driver != "reflexion":
        assert in_process(capsys, "experience", str(source)) == 0
    if broken:  # what the finished work left (odd text: the same as above)
        assert in_process(capsys, "report", str(result)) == 0
        assert in_process(capsys, "export", str(result)) == 0


# -- numbers: a budget holds, a report reads any store -------------------------------------------
def test_bad_usage_is_retried_and_the_token_budget_holds(
    generated_games: Path, tmp_path: Path
) -> None:
    """Every answer's first attempt reports -10^9 tokens: it is retried (never counted), so
    --budget-tokens still stops the run, and every recorded count is the good answer's."""
    plan = FaultPlan(rate=1.0, kinds=("negative_usage",), max_faults_per_key=1)
    with FaultServer(plan, answer=answer) as server:
        cfg = game_run(
            generated_games, tmp_path, "run", "reflexion", model="openai:t", base_url=server.url,
            trials=3, max_steps=3, task_types=("heat",), budget_tokens=50, concurrency=1,
            backend_options={"max_retries": 1, "backoff_base": 0.01, "jitter": 0},
        )  # fmt: skip
        run(cfg)
        faults = server.stats()["negative_usage"]
    with RunReader(tmp_path / "run") as store:
        state, calls = store.run_state(), store.model_calls()
        totals = store.token_totals()
    assert state.stopped and "token budget 50" in state.stopped
    assert faults == len(calls) and all(c.retries == 1 for c in calls)
    # each call's record keeps why its first attempt failed, and the request as sent
    assert all(len(c.attempt_errors) == 1 and c.sent is not None for c in calls)
    assert all(min(c.prompt_tokens, c.completion_tokens, c.cached_tokens) >= 0 for c in calls)
    assert 50 <= totals.total < 50 + max(c.prompt_tokens + c.completion_tokens for c in calls)


def test_a_report_reads_a_store_holding_negative_counts(tmp_path: Path) -> None:
    """A store written before counts were checked may hold -10^9 tokens: the report says what
    it holds and costs them at nothing, never fails."""
    run_dir = make_run(tmp_path / "run", standard_tasks(), model="openai:gpt-4o-mini")
    store = RunStore(run_dir)
    store.add_model_call(ModelCall(purpose="act", game="g", trial=0, prompt_tokens=-(10**9)))
    store.close()
    report = write_report([run_dir])
    summary = json.loads((report / "summary.json").read_text())
    assert summary["cost_usd"] == 0 and summary["tokens"]["prompt"] == 0


# -- another run's stored meta ---------------------------------------------------------------------
def test_rules_kept_with_a_lone_surrogate_are_shown_storable(
    generated_games: Path, source: Path, tmp_path: Path
) -> None:
    """A gathering run whose kept rules hold a lone surrogate (JSON can: an older version kept
    one so): a run shown them plays, its prompt holding U+FFFD."""
    extract_rules(source, "scripted:expert")
    store = RunStore(source)
    kept = store.get_meta(INSIGHTS_KEY)
    kept["rules"][0]["text"] = "Open the \ud800 microwave first."
    store.set_meta(INSIGHTS_KEY, kept)  # json.dumps writes it as "\ud800"
    store.close()
    cfg = game_run(
        generated_games, tmp_path, "run", "insights", model="scripted:learner", max_steps=3,
        task_types=("heat",), experience_from=str(source),
    )  # fmt: skip
    with RunReader(run(cfg)) as reader:
        (episode,) = reader.episodes()
    assert "Open the \ufffd microwave first." in episode.prompt_prefix


RULE = {"task_type": "heat", "text": "Heat it first.", "votes": 1}
STEP = {"task_type": "heat", "games": ["g"], "applied": [], "ignored": [], "rules_after": 1}


@pytest.mark.parametrize(
    "meta",
    [
        ["not", "an", "object"],
        {"rules": {"heat": RULE}, "steps": []},
        {"rules": [{**RULE, "votes": "1"}], "steps": [STEP]},
        {"rules": [{**RULE, "votes": True}], "steps": [STEP]},
        '{"rules": [{"task_type": "heat", "text": "x", "votes": 1%s}], "steps": []}' % ("0" * 5000),
        {"rules": [{**RULE, "votes": -1}], "steps": [STEP]},
        {"rules": [{"task_type": "heat", "votes": 1}], "steps": [STEP]},
        {"rules": [RULE], "steps": [{**STEP, "rules_after": None}]},
        {"rules": [RULE], "steps": ["a step"]},
    ],
    ids=[
        "list", "rules-object", "votes-string", "votes-bool", "votes-huge", "votes-negative",
        "no-text", "step-count", "step-string",
    ],
)  # fmt: skip
def test_a_malformed_kept_rule_list_is_one_line_naming_extract(
    meta: object,
    generated_games: Path,
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A gathering run whose kept rule list is not what extraction writes: ``experience`` and a
    run shown it say so in one line naming ``reflexsim extract`` (exit 2, nothing written; it is
    not made again silently, which would drop a hand edit); ``extract`` replaces it."""
    store = RunStore(source)
    store.set_meta(INSIGHTS_KEY, meta)
    store.close()
    if isinstance(meta, str):  # JSON text as it is (5,000 digits: past Python's int limit)
        with sqlite3.connect(source / "run.sqlite") as db:
            db.execute("UPDATE meta SET value=? WHERE key=?", (meta, INSIGHTS_KEY))
    out = tmp_path / "run"
    commands = [
        ["experience", str(source)],
        ["run", "--agent", "insights", "--model", "scripted:learner", "--data",
         str(generated_games), "--split", SPLIT, *HEAT, "--experience-from", str(source),
         "--run-dir", str(out)],
    ]  # fmt: skip
    for args in commands:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "malformed" in err[0], err
        assert f"reflexsim extract {source} --model" in err[0]
    assert not out.exists()
    assert in_process(capsys, "report", str(source)) == 0  # shown without its rules
    assert in_process(capsys, "extract", str(source), "--model", "scripted:expert") == 0
    with RunReader(source) as reader:
        assert [r["task_type"] for r in reader.get_meta(INSIGHTS_KEY)["rules"]] == ["heat"]


def test_extraction_reads_every_operation_line(source: Path) -> None:
    """The extraction prompt asks for one operation a line: the request does not stop at the
    first newline (a server that honours stops sent only the first operation)."""
    with FaultServer(answer=lambda _: "ADD: Look first.\nADD: Then act.\nthat is all") as server:
        kept = extract_rules(source, "openai:t", options={"base_url": server.url})
        (body,) = server.bodies
    assert "stop" not in body
    assert [r["text"] for r in kept["rules"]] == ["Look first.", "Then act."]
    assert kept["steps"][0]["ignored"] == ["that is all"]


def test_a_servers_error_text_is_stored_and_logged_whatever_it_holds(
    generated_games: Path, tmp_path: Path
) -> None:
    """A 400 whose message holds terminal escapes and a lone surrogate: the episode's error is
    stored (U+FFFD), run.log and stderr show it escaped (run.log stopped at such a line)."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultPlan(rate=1.0, kinds=("odd_error",)), answer=answer) as server:
        r = reflexsim(*driver_args("reflexion", generated_games, tmp_path, run_dir, server.url))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "\x1b" not in r.stderr and "\\ud800 here" in r.stderr
    log = (run_dir / "run.log").read_text()
    assert "\x1b" not in log and "\\ud800 here" in log
    with RunReader(run_dir) as store:
        (episode,) = store.episodes()
        (error,) = store.episode_errors(episode.episode_id)
    assert "\ufffd here" in str(episode.error) and "\ufffd here" in error.traceback
