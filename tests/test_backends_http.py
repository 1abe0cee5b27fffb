"""The HTTP backends against a real local server that injects faults (tests/fault_server.py):
every answer correct, every retry counted and logged, Retry-After honoured, keys never leaked."""

from __future__ import annotations

import json
import logging
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from agents.llm import BackendError, GenerationConfig, Message, Request, make_backend
from agents.llm.common import CONTINUE_INSTRUCTION

try:
    from tests.fault_server import FAULT_KINDS, FaultPlan, FaultServer, echo_answer, word_count
except ImportError:  # tests/ run as a rootdir-less folder
    from fault_server import FAULT_KINDS, FaultPlan, FaultServer, echo_answer, word_count

FAST = {
    "timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
    "jitter": 0.01,
    "max_retries": 12,
    "concurrency": 16,
}
RETRY_AFTER = 0.25
FAULTY = FaultPlan(rate=0.2, seed=7, timeout_s=1.5, retry_after=str(RETRY_AFTER))
CFG = GenerationConfig(max_tokens=20, stop=("\n",), seed=0)


@pytest.fixture(autouse=True)
def _no_real_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-local-test-key")


def _prompts(n: int, tag: str = "") -> list[str]:
    return [f"Step {i}{tag}: you see a drawer {i % 7} and a desk.\n>" for i in range(n)]


def _check_faults_and_retries(
    server: FaultServer, completions: list[Any], records: list[logging.LogRecord], logger: str
) -> dict[str, int]:
    stats = server.stats()
    retries = sum(c.retries for c in completions)
    # every attempt reached the server: one per answer plus one per retry
    assert stats["requests"] == len(completions) + retries
    # every injected fault cost a retry (a busy machine may add a real timeout or two)
    assert retries >= stats["requests"] - stats["answered"] > 0
    retry_logs = [r for r in records if r.name == logger and "retry" in r.getMessage()]
    assert len(retry_logs) == retries
    return stats


def _check_retry_after(server: FaultServer) -> int:
    """Every attempt after a 429 came at least Retry-After seconds after the 429 was sent."""
    by_key: dict[str, list[Any]] = defaultdict(list)
    for e in server.events:
        by_key[e.key].append(e)
    checked = 0
    for events in by_key.values():
        events.sort(key=lambda e: e.attempt)
        for prev, nxt in zip(events, events[1:], strict=False):
            if prev.fault == "429":
                assert prev.answered is not None
                assert nxt.arrived - prev.answered >= RETRY_AFTER * 0.95
                checked += 1
    return checked


def test_openai_completions_batch_of_200_survives_20_percent_faults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts = _prompts(200)
    with FaultServer(FAULTY) as server, caplog.at_level(logging.WARNING):
        backend = make_backend("openai:fault-model", base_url=server.url, **FAST)
        out = backend.generate([Request(config=CFG, prompt=p) for p in prompts])
        backend.close()
    assert [c.text for c in out] == [echo_answer(p) for p in prompts]
    stats = _check_faults_and_retries(server, out, caplog.records, "agents.llm.openai")
    for kind in FAULT_KINDS:
        assert stats.get(kind, 0) >= 1, f"no {kind} fault was injected: {stats}"
    assert 0.1 < (stats["requests"] - 200) / stats["requests"] < 0.3
    assert _check_retry_after(server) == stats["429"]
    # usage as the server reported it; what was sent is recorded
    assert out[0].prompt_tokens == word_count(prompts[0])
    assert out[0].completion_tokens == word_count(echo_answer(prompts[0]))
    assert out[0].cached_tokens == word_count(prompts[0]) // 2
    assert out[0].sent["endpoint"] == "completions" and out[0].sent["prompt"] == prompts[0]
    assert out[0].sent["max_tokens"] == 20 and out[0].sent["stop"] == ["\n"]


def test_openai_chat_endpoint_wraps_prompts_and_survives_faults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts = _prompts(80, " chat")
    with FaultServer(FAULTY) as server, caplog.at_level(logging.WARNING):
        backend = make_backend("openai:fault-model", base_url=server.url, api="chat", **FAST)
        out = backend.generate([Request(config=CFG, prompt=p) for p in prompts])
        backend.close()
    expected = [echo_answer(f"user: {CONTINUE_INSTRUCTION}\n\n{p}") for p in prompts]
    assert [c.text for c in out] == expected
    _check_faults_and_retries(server, out, caplog.records, "agents.llm.openai")
    assert out[0].sent["messages"] == [
        {"role": "user", "content": f"{CONTINUE_INSTRUCTION}\n\n{prompts[0]}"}
    ]


def test_openai_chat_messages_prefill_and_n(monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultServer() as server:
        backend = make_backend(
            "openai:fault-model", base_url=server.url, api="chat", chat_format="prefill"
        )
        msgs = (Message("system", "Be brief."), Message("user", "Hello"))
        chat, prefill, many = backend.generate(
            [
                Request(config=CFG, messages=msgs),
                Request(config=CFG, prompt="> go to"),
                Request(config=GenerationConfig(n=3), messages=msgs),
            ]
        )
        backend.close()
        bodies = server.bodies
    assert chat.text == echo_answer("system: Be brief.\nuser: Hello")
    assert prefill.sent["messages"][-1] == {"role": "assistant", "content": "> go to"}
    prefill_body = next(b for b in bodies if b["messages"][-1]["role"] == "assistant")
    assert prefill_body["continue_final_message"] is True
    assert prefill_body["add_generation_prompt"] is False
    assert many.alternatives == (many.text + " #1", many.text + " #2")


def test_non_retryable_errors_fail_at_once_and_exhausted_retries_name_the_cause() -> None:
    with FaultServer(api_key="right-key-0123456789") as server:
        backend = make_backend("openai:m", base_url=server.url, **FAST)
        with pytest.raises(BackendError, match="AuthenticationError") as info:
            backend.generate([Request(config=CFG, prompt="hi")])
        assert "\n" not in str(info.value)
        assert server.stats()["requests"] == 1  # 401 is not retried
        backend.close()
    with FaultServer(FaultPlan(rate=1.0, kinds=("500",))) as server:
        backend = make_backend("openai:m", base_url=server.url, **{**FAST, "max_retries": 3})
        with pytest.raises(BackendError, match=r"gave up after 4 attempts: HTTP 500"):
            backend.generate([Request(config=CFG, prompt="hi")])
        assert server.stats()["requests"] == 4
        backend.close()


def test_requests_are_in_flight_together_up_to_the_limit() -> None:
    with FaultServer(FaultPlan(latency_s=0.2)) as server:
        backend = make_backend("openai:m", base_url=server.url, concurrency=4)
        out = backend.generate([Request(config=CFG, prompt=p) for p in _prompts(12)])
        backend.close()
        events = server.events
    assert len(out) == 12
    # the most requests the server held at one moment
    points = sorted([(e.arrived, 1) for e in events] + [(e.answered or 0.0, -1) for e in events])
    depth = peak = 0
    for _, d in points:
        depth += d
        peak = max(peak, depth)
    assert 2 <= peak <= 4


def test_anthropic_backend_survives_faults_and_maps_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts = _prompts(60, " claude")
    with FaultServer(FAULTY) as server, caplog.at_level(logging.WARNING):
        backend = make_backend("anthropic:claude-test", base_url=server.root, **FAST)
        out = backend.generate([Request(config=CFG, prompt=p) for p in prompts])
        sys_msg = (Message("system", "Be brief."), Message("user", "Hello"))
        chat = backend.generate([Request(config=CFG, messages=sys_msg)])[0]
        backend.close()
        bodies = server.bodies
    assert [c.text for c in out] == [
        echo_answer(f"user: {CONTINUE_INSTRUCTION}\n\n{p}") for p in prompts
    ]
    _check_faults_and_retries(server, [*out, chat], caplog.records, "agents.llm.anthropic")
    assert chat.text == echo_answer("system: Be brief.\nuser: Hello")
    body = bodies[-1]
    assert body["system"] == "Be brief." and "temperature" not in body
    assert "stop_sequences" not in body  # "\n" is whitespace-only: applied to the text instead
    assert chat.sent["stop_applied_locally"] == ["\n"] and chat.sent["sampling"] == "model default"
    assert out[0].prompt_tokens == word_count(f"user: {CONTINUE_INSTRUCTION}\n\n{prompts[0]}")
    assert out[0].cached_tokens == out[0].prompt_tokens // 2
    assert "omitted" in backend.describe()["sampling"]
    assert any("not sent" in r.getMessage() for r in caplog.records)


def test_anthropic_sampling_send_and_prefill() -> None:
    with FaultServer() as server:
        backend = make_backend(
            "anthropic:claude-test", base_url=server.root, sampling="send", chat_format="prefill"
        )
        c = backend.generate(
            [Request(config=GenerationConfig(temperature=0.7, top_p=0.9), prompt="go to >  ")]
        )[0]
        backend.close()
        body = server.bodies[-1]
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["messages"][-1] == {"role": "assistant", "content": "go to >"}
    assert c.sent["messages"][-1]["content"] == "go to >"


def test_api_key_canary_never_reaches_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary = f"sk-canary-{uuid.uuid4().hex}"
    wrong = f"sk-canary-wrong-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENAI_API_KEY", canary)
    monkeypatch.setenv("OTHER_KEY", wrong)
    monkeypatch.setenv("OPENAI_LOG", "debug")
    log_file = tmp_path / "debug.log"
    handler = logging.FileHandler(log_file)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s %(args)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for name in ("openai", "httpx", "httpx2", "httpcore", "agents"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        with FaultServer(FAULTY, api_key=canary) as server:
            backend = make_backend("openai:fault-model", base_url=server.url, **FAST)
            out = backend.generate([Request(config=CFG, prompt=p) for p in _prompts(40)])
            (tmp_path / "describe.json").write_text(json.dumps(backend.describe()))
            (tmp_path / "sent.json").write_text(json.dumps([c.sent for c in out]))
            (tmp_path / "repr.txt").write_text(repr(backend) + str(out[0]))
            bad = make_backend(
                "openai:fault-model", base_url=server.url, api_key_env="OTHER_KEY", **FAST
            )
            with pytest.raises(BackendError) as info:
                bad.generate([Request(config=CFG, prompt="hello")])
            logging.getLogger("experiments.runner").error("infra error: %s", info.value)
            (tmp_path / "error.txt").write_text(str(info.value))
            backend.close()
            bad.close()
            seen = server.keys_seen
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(old_level)
    assert canary in seen and wrong in seen  # the keys really were sent to the server
    assert sum(c.retries for c in out) > 0
    assert "retry" in log_file.read_text()  # the log is really there
    written = list(tmp_path.rglob("*"))
    assert len(written) >= 5
    for path in written:
        if path.is_file():
            text = path.read_text(errors="replace")
            for secret in (canary, wrong):
                assert secret not in text, f"key leaked into {path.name}"
                assert secret[:16] not in text and secret[-12:] not in text
