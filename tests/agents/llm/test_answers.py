"""The checks an answer passes where it enters (agents/llm/answers.py): storable text, whole
non-negative token counts, answer shapes; each misbehaviour of a real local server (see
tests/support/fault_server.py) against the OpenAI (completions and chat) and Anthropic backends."""

from __future__ import annotations

import math
import sqlite3

import pytest

from agents.insights import parse_ops
from agents.llm import make_backend
from agents.llm.answers import MalformedResponse, count, small_number, storable, storable_data
from agents.llm.base import BackendError, Completion, GenerationConfig, Message, Request
from agents.llm.common import MAX_CHARS_PER_TOKEN
from agents.values import parse_rating
from tests.support.fault_server import (
    BROKEN_ANSWERS,
    CONTROLS,
    GARBAGE,
    ODD_ANSWERS,
    FaultPlan,
    FaultServer,
)

CFG = GenerationConfig(max_tokens=20, stop=("\n",))
FAST = {"max_retries": 1, "backoff_base": 0.01, "jitter": 0, "timeout": 20}
WAYS = ("completions", "chat", "anthropic")


def test_text_is_made_storable_and_counted() -> None:
    assert storable("plain") == ("plain", 0)
    assert storable("caf\u00e9 \u4e2d") == ("caf\u00e9 \u4e2d", 0)
    text, bad = storable("a\ud800b\udfffc")
    assert (text, bad) == ("a\ufffdb\ufffdc", 2)
    text.encode("utf-8")  # storable
    data = storable_data({"k\udc00": ["x\ud800", {"y": "z\udbff"}], "n": 3})
    assert data == {"k\ufffd": ["x\ufffd", {"y": "z\ufffd"}], "n": 3}


def test_a_completion_and_an_error_hold_only_storable_text() -> None:
    """What a backend gives a Completion (text, alternatives) or a BackendError (a server's
    error text) is storable: SQLite takes it."""
    c = Completion("go \ud800", alternatives=("\udfff", "ok"))
    assert (c.text, c.alternatives, c.invalid_text) == ("go \ufffd", ("\ufffd", "ok"), 2)
    error = BackendError("HTTP 500: \ud83d")
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t(x TEXT)")
    db.executemany("INSERT INTO t VALUES (?)", [(c.text,), (c.alternatives[0],), (str(error),)])
    assert Completion("clean").invalid_text == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 0), (0, 0), (12, 12), (12.0, 12), (10**12, 10**12)],
)
def test_a_count_is_a_whole_non_negative_number(value: object, expected: int) -> None:
    assert count(value, "n") == expected


@pytest.mark.parametrize(
    "value", [-1, -1e9, 1.5, math.inf, -math.inf, math.nan, "12", "", True, [3], {"n": 3}]
)
def test_anything_else_is_a_malformed_answer(value: object) -> None:
    with pytest.raises(MalformedResponse, match="usage.prompt_tokens"):
        count(value, "usage.prompt_tokens")


def test_numbers_a_model_writes_are_read_only_when_short() -> None:
    assert small_number("42") == 42 and small_number("9" * 9) == 10**9 - 1
    assert small_number("9" * 10) is None and small_number("9" * 5000) is None
    ops, ignored = parse_ops(GARBAGE)  # never int() of 5,000 digits
    assert [(o.kind, o.number) for o in ops] == [("EDIT", 0)]  # applies to no rule
    assert len(ignored) == 6
    assert parse_rating("9" * 5000) == 1.0 and parse_rating("rated 7") == 2 / 3


def _backend(way: str, server: FaultServer) -> object:
    if way == "anthropic":
        return make_backend("anthropic:x", base_url=server.root, **FAST)
    return make_backend("openai:x", base_url=server.url, **FAST)


def _request(way: str) -> Request:
    if way == "chat":
        return Request(config=CFG, messages=(Message("user", "hi"),))
    return Request(config=CFG, prompt="hi")


@pytest.fixture(autouse=True)
def _anthropic_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")


@pytest.mark.parametrize("kind", ["malformed", *BROKEN_ANSWERS])
@pytest.mark.parametrize("way", WAYS)
def test_a_broken_answer_is_retried_then_the_requests_error(way: str, kind: str) -> None:
    """Bad counts, no choices, a body that is not JSON or is cut mid-way: each attempt is a
    server fault (retried), and the request ends as a BackendError naming it; a server that
    misbehaves once is answered on the retry."""
    with FaultServer(FaultPlan(rate=1.0, kinds=(kind,))) as server:
        backend = _backend(way, server)
        with pytest.raises(BackendError, match="gave up after 2 attempts") as info:
            backend.generate([_request(way)])  # type: ignore[attr-defined]
        backend.close()  # type: ignore[attr-defined]
        assert server.stats() == {"requests": 2, kind: 2}
    assert info.value.retries == 1
    once = FaultPlan(rate=1.0, kinds=(kind,), max_faults_per_key=1)
    with FaultServer(once) as server:
        backend = _backend(way, server)
        (answer,) = backend.generate([_request(way)])  # type: ignore[attr-defined]
        backend.close()  # type: ignore[attr-defined]
    assert answer.retries == 1 and answer.text.startswith(" ok ")
    assert min(answer.prompt_tokens, answer.completion_tokens) >= 1


@pytest.mark.parametrize("kind", ODD_ANSWERS)
@pytest.mark.parametrize("way", WAYS)
def test_odd_text_is_taken_storable_and_cut_to_max_tokens(way: str, kind: str) -> None:
    good = " look around"
    with FaultServer(FaultPlan(rate=1.0, kinds=(kind,)), answer=lambda _: good) as server:
        backend = _backend(way, server)
        (answer,) = backend.generate([_request(way)])  # type: ignore[attr-defined]
        backend.close()  # type: ignore[attr-defined]
    answer.text.encode("utf-8")
    assert answer.retries == 0
    assert len(answer.text) <= CFG.max_tokens * MAX_CHARS_PER_TOKEN
    expected = {
        "surrogate": (good[:3] + "\ufffd" + good[3:], "stop", 1),
        "control": (good[:3] + CONTROLS + good[3:], "stop", 0),
        "garbage": (GARBAGE.split("\n")[0][: CFG.max_tokens * MAX_CHARS_PER_TOKEN], None, 0),
        "huge": (None, "oversized", 0),
    }[kind]
    text, finish, invalid = expected
    assert text is None or answer.text == text
    assert finish is None or answer.finish_reason == finish
    assert answer.invalid_text == invalid
