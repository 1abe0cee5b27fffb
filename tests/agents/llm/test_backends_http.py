"""The HTTP backends against a real local server that injects faults (tests/support/fault_server.py):
every answer correct, every retry counted and logged, Retry-After honoured, keys never leaked."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from agents.llm import (
    BackendError,
    CallSite,
    GenerationConfig,
    Message,
    Request,
    SpecError,
    make_backend,
)
from agents.llm.common import CONTINUE_INSTRUCTION

try:
    from tests.support.fault_server import (
        FAULT_KINDS,
        FaultPlan,
        FaultServer,
        echo_answer,
        word_count,
    )
except ImportError:  # tests/ run as a rootdir-less folder
    from tests.support.fault_server import (
        FAULT_KINDS,
        FaultPlan,
        FaultServer,
        echo_answer,
        word_count,
    )

FAST = {
    "timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
    "jitter": 0.01,
    "max_retries": 12,
    "concurrency": 16,
}
ROOT = Path(__file__).resolve().parent.parent.parent.parent
SPLIT = "eval_out_of_distribution"
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
    # one attempt per answer plus one per retry; on a loaded machine an attempt can time out
    # before the server reads it, and only such client-side failures may be missing there
    unseen = len(completions) + retries - stats["requests"]
    client_side = sum(
        e == "timeout" or e.startswith("connection error")
        for c in completions
        for e in c.attempt_errors
    )
    assert 0 <= unseen <= client_side - stats.get("timeout", 0) - stats.get("reset", 0)
    # every injected fault cost a retry (a busy machine may add a real timeout or two)
    assert retries >= stats["requests"] - stats["answered"] > 0
    retry_logs = [r for r in records if r.name == logger and "retry" in r.getMessage()]
    assert len(retry_logs) == retries
    # why each failed attempt failed goes back with the answer (the run store keeps it)
    assert [len(c.attempt_errors) for c in completions] == [c.retries for c in completions]
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


def test_served_actor_requests_carry_their_episodes_session_id_where_enabled() -> None:
    """A ``vllm:`` model at a server sends ``session_id`` (vLLM's request field) with its actor
    requests, each its episode's id, on both endpoints; not with a reflection, and not at all
    where it is off: an ``openai:`` model unless asked, or a ``vllm:`` one told not to."""

    def act(episode: str, prompt: str) -> Request:
        return Request(config=CFG, prompt=prompt, site=CallSite(episode=episode, game="g"))

    requests = [
        act("g#t0", "> look"),
        act("g#t0", "> look\nYou see a desk.\n> go to desk 1"),
        act("g#t1", "> look"),
        Request(config=CFG, prompt="Reflect.", purpose="reflect", site=CallSite(episode="g#t0")),
    ]
    cases = [
        ("vllm:m", {}, ["g#t0", "g#t0", "g#t1", None]),
        ("vllm:m", {"api": "chat"}, ["g#t0", "g#t0", "g#t1", None]),
        ("vllm:m", {"send_session_id": "false"}, [None] * 4),
        ("openai:m", {}, [None] * 4),
        ("openai:m", {"send_session_id": "true"}, ["g#t0", "g#t0", "g#t1", None]),
    ]
    with FaultServer() as server:
        for spec, options, expected in cases:
            backend = make_backend(spec, base_url=server.url, concurrency=1, **options)
            out = backend.generate(requests)
            backend.close()
            bodies = server.bodies[-len(requests) :]
            assert [b.get("session_id") for b in bodies] == expected, (spec, options)
            assert [(c.sent.get("extra_body") or {}).get("session_id") for c in out] == expected
            assert backend.describe()["send_session_id"] is (expected[0] is not None)
    with pytest.raises(SpecError, match="send_session_id is for a vLLM server"):
        make_backend("openai:m", send_session_id=True)


def test_non_retryable_errors_fail_at_once_and_exhausted_retries_name_the_cause() -> None:
    with FaultServer(api_key="right-key-0123456789") as server:
        backend = make_backend("openai:m", base_url=server.url, **FAST)
        with pytest.raises(BackendError, match="HTTPError: HTTP 401") as info:
            backend.generate([Request(config=CFG, prompt="hi")])
        assert "\n" not in str(info.value)
        assert server.stats()["requests"] == 1  # 401 is not retried
        backend.close()
    with FaultServer(FaultPlan(rate=1.0, kinds=("500",))) as server:
        backend = make_backend("openai:m", base_url=server.url, **{**FAST, "max_retries": 3})
        with pytest.raises(BackendError, match=r"gave up after 4 attempts: HTTP 500") as info:
            backend.generate([Request(config=CFG, prompt="hi")])
        assert server.stats()["requests"] == 4
        errors = info.value.attempt_errors
        assert len(errors) == 4 and all("500" in e for e in errors)
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


# -- deadlines, cancellation, retries of a failed call, oversized answers -----------------------
DEADLINE = {
    "timeout": 1.0,
    "max_retries": 1,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
    "jitter": 0,
}
# No upper bound on a time is asserted: a loaded machine may be slow. An attempt that outlived
# its deadline shows otherwise: a trickled body ends in an answer (not a timeout error), an
# endless one never ends, a 429's Retry-After (60 s) outlasts the 30 s join below.


def _spec(server: FaultServer, which: str) -> tuple[str, str]:
    return ("openai:x", server.url) if which == "openai" else ("anthropic:x", server.root)


@pytest.mark.parametrize(
    "which,kind", [("openai", "trickle"), ("openai", "endless"), ("anthropic", "endless")]
)
def test_a_trickled_or_endless_body_ends_within_its_deadline_and_retry(which, kind) -> None:
    """httpx's read timeout is per chunk: a body sent slowly, or never finished, held a request
    for ever. Now timeout= bounds each whole attempt, and the retry gets one of its own."""
    with FaultServer(FaultPlan(rate=1.0, kinds=(kind,), trickle_s=0.05)) as server:
        spec, url = _spec(server, which)
        backend = make_backend(spec, base_url=url, **DEADLINE)
        started = time.monotonic()
        with pytest.raises(BackendError, match="gave up after 2 attempts: timeout") as info:
            backend.generate([Request(config=CFG, prompt="hi")])
        elapsed = time.monotonic() - started
        backend.close()
        assert server.stats() == {"requests": 2, kind: 2}
    assert info.value.retries == 1
    budget = (DEADLINE["max_retries"] + 1) * DEADLINE["timeout"] + DEADLINE["backoff_max"]
    assert 0.9 * budget <= elapsed, elapsed  # both attempts waited out their deadline
    print(f"\n{which} {kind}: gave up after {elapsed:.2f}s (2 attempts of 1 s)")


def test_a_slow_body_that_ends_within_the_deadline_is_answered() -> None:
    with FaultServer(FaultPlan(rate=1.0, kinds=("trickle",), trickle_s=0.001)) as server:
        backend = make_backend("openai:x", base_url=server.url, **{**DEADLINE, "timeout": 30})
        out = backend.generate([Request(config=CFG, prompt="hi")])
        backend.close()
    assert out[0].text == echo_answer("hi") and out[0].retries == 0


@pytest.mark.parametrize(
    "which,kind",
    [("openai", "endless"), ("anthropic", "endless"), ("sharded", "endless"), ("openai", "429")],
)
def test_close_ends_requests_in_flight_at_once(which, kind) -> None:
    """An interrupted run closes its backends: a request blocked on an endless body, or waiting
    out a 429's Retry-After, ends then (not at its deadline), and nothing is sent after."""
    plan = FaultPlan(rate=1.0, kinds=(kind,), trickle_s=0.05, retry_after="60")
    with FaultServer(plan) as server, FaultServer(plan) as other:
        if which == "sharded":
            backend = make_backend(
                "openai:x", base_url=f"{server.url},{other.url}", timeout=60, max_retries=3
            )
        else:
            spec, url = _spec(server, which)
            backend = make_backend(spec, base_url=url, timeout=60, max_retries=3)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                backend.generate([Request(config=CFG, prompt="hi")])
            except BaseException as exc:  # noqa: B036 - checked below
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        while not server.events and not other.events:
            time.sleep(0.01)
        time.sleep(0.2)  # into the body, or the wait before the retry
        started = time.monotonic()
        backend.close()
        thread.join(timeout=30)
        elapsed = time.monotonic() - started
        requests = server.stats().get("requests", 0) + other.stats().get("requests", 0)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], BackendError)
    assert "cancelled" in str(errors[0]), errors[0]
    assert requests == 1  # no retry, no failover
    print(f"\n{which} {kind}: the request ended {elapsed * 1000:.0f} ms after close()")


def test_a_failed_call_records_the_retries_it_made(generated_games, tmp_path) -> None:
    from experiments.config import RunConfig
    from experiments.session import run
    from experiments.store import RunStore

    with FaultServer(FaultPlan(rate=1.0, kinds=("500",))) as server:
        cfg = RunConfig.of(
            model="openai:x", base_url=server.url, data=str(generated_games), split=SPLIT,
            games=1, trials=1, max_steps=2, workers=1, concurrency=1,
            run_dir=str(tmp_path / "run"), backend_options={**FAST, "max_retries": 2},
        )  # fmt: skip
        run(cfg)
        requests = server.stats()["requests"]
    store = RunStore(tmp_path / "run", readonly=True)
    calls = store.model_calls()
    assert calls and all(c.error and c.retries == 2 for c in calls), calls
    assert requests == 3 * len(calls)
    assert store.events("retry") and store.events("infra_error")
    store.close()


def test_an_oversized_completion_is_cut_flagged_and_recorded(
    generated_games, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4 MB answer to a request for max_tokens=20: a server fault, never stored whole."""
    from agents.llm.base import OVERSIZED
    from agents.llm.common import MAX_CHARS_PER_TOKEN
    from experiments.config import RunConfig
    from experiments.session import run
    from experiments.store import RunStore

    huge = " look" + "x" * 4_000_000
    with FaultServer(answer=lambda prompt: huge) as server, caplog.at_level(logging.WARNING):
        backend = make_backend("openai:x", base_url=server.url, **FAST)
        plain, chat = backend.generate(
            [
                Request(config=CFG, prompt="hi"),
                Request(config=CFG, messages=(Message("user", "hi"),)),
            ]
        )
        backend.close()
        cfg = RunConfig.of(
            model="openai:x", base_url=server.url, data=str(generated_games), split=SPLIT,
            games=1, trials=1, max_steps=2, workers=1, concurrency=1,
            run_dir=str(tmp_path / "run"), backend_options=FAST,
        )  # fmt: skip
        run(cfg)
    for c in (plain, chat):
        assert c.finish_reason == OVERSIZED
        assert c.text == huge[: CFG.max_tokens * MAX_CHARS_PER_TOKEN]
    assert any("4000005 characters for max_tokens=20" in r.getMessage() for r in caplog.records)
    store = RunStore(tmp_path / "run", readonly=True)
    steps = [s for e in store.episodes() for s in store.steps(e.episode_id)]
    assert steps and all(len(s.raw_output) < 100_000 for s in steps)
    assert store.events("oversized")
    store.close()


def test_sigint_during_a_hung_request_exits_at_once_and_resume_finishes(
    generated_games, tmp_path
) -> None:
    """Ctrl-C (SIGINT to the process group) while a request reads an endless body: the run ends
    with 130 at once (the request is aborted, no thread is waited for), the store is readable
    and --resume against a good server finishes the interrupted episode."""
    from experiments.store import RunStore

    run_dir = tmp_path / "run"
    args = ["--data", str(generated_games), "--split", SPLIT, "--games", "1", "--trials", "1",
            "--max-steps", "3", "--workers", "1", "--concurrency", "1",
            "--backend-option", "timeout=60", "--backend-option", "max_retries=2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--model", "openai:x", *args]
    hung = FaultPlan(rate=1.0, kinds=("endless",), trickle_s=0.05)
    with FaultServer(hung) as server:
        port = server.port
        proc = subprocess.Popen(
            [*cmd, "--base-url", server.url, "--run-dir", str(run_dir)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not server.events:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no request in 120 s"
                time.sleep(0.02)
            time.sleep(0.5)  # into the endless body
            started = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            # a hang guard, not a timing: the request's own deadline is 60 s, retried
            _, err = proc.communicate(timeout=45)
            elapsed = time.monotonic() - started
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    store = RunStore(run_dir, readonly=True)
    assert [e.status for e in store.episodes()] == ["interrupted"]  # kept for the resume
    assert store.run_state().status == "interrupted"
    store.close()
    with FaultServer(FaultPlan(), answer=lambda prompt: " look", port=port) as server:
        r = subprocess.run(
            [*cmd, "--base-url", server.url, "--resume", str(run_dir)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    store = RunStore(run_dir, readonly=True)
    assert [e.status for e in store.episodes()] == ["done"]
    store.close()
    print(f"\nSIGINT during an endless body: exit 130 after {elapsed:.2f}s")


def test_openai_requests_on_the_wire_are_what_the_openai_sdk_sends() -> None:
    """The backend's own HTTP path sends each request's body (parameters, ``extra_body``
    merged) and routing header as the OpenAI SDK sends the same recorded parameters."""
    openai = pytest.importorskip("openai")
    act = CallSite(episode="g#t0", game="g")
    requests = [
        Request(config=GenerationConfig(max_tokens=7, stop=("\n", "END"), seed=3), prompt="> "),
        Request(config=CFG, prompt="> look", site=act),
        Request(config=GenerationConfig(n=2, temperature=0.7), messages=(Message("user", "Hi"),)),
    ]
    cases = [
        ("vllm:m", {"data_parallel_size": 2}),
        ("openai:m", {"api": "chat", "chat_format": "prefill"}),
        ("openai:m", {"extra_body": {"repeat_penalty": 1.0}}),
    ]
    with FaultServer() as server:
        for spec, options in cases:
            backend = make_backend(spec, base_url=server.url, concurrency=1, **options)
            out = backend.generate(requests)
            backend.close()
            ours = server.bodies[-len(requests) :], server.headers[-len(requests) :]
            sdk = openai.OpenAI(api_key="sk-local-no-key", base_url=server.url, max_retries=0)
            for completion in out:
                params = {k: v for k, v in completion.sent.items() if k != "endpoint"}
                api = (
                    sdk.chat.completions
                    if completion.sent["endpoint"] == "chat"
                    else sdk.completions
                )
                api.create(**params)
            sdk.close()
            theirs = server.bodies[-len(requests) :], server.headers[-len(requests) :]
            assert ours[0] == theirs[0], spec
            for mine, its in zip(ours[1], theirs[1], strict=True):
                for name in ("authorization", "content-type", "x-data-parallel-rank"):
                    assert mine.get(name) == its.get(name), (spec, name)
        # a user and password in the URL: the SDK sends them as basic auth, and so does this
        url = server.url.replace("http://", "http://user:pass%2Fword@")
        backend = make_backend("openai:m", base_url=url)
        backend.generate(requests[:1])
        backend.close()
        sdk = openai.OpenAI(api_key="sk-local-no-key", base_url=url, max_retries=0)
        sdk.completions.create(model="m", prompt="> ", max_tokens=7)
        sdk.close()
        mine, its = server.headers[-2:]
        assert mine["authorization"] == its["authorization"]
        assert mine["authorization"].startswith("Basic ")


def test_agenerate_is_awaited_on_the_callers_loop_and_ends_as_generate_does() -> None:
    """``agenerate`` from an event loop: the answers ``generate`` gives, at most ``concurrency``
    in flight; a caller that cancels its await cancels its request only; ``close()`` ends one
    blocked on an endless body with the backend's error, not a cancellation."""
    import asyncio

    prompts = _prompts(24)
    with FaultServer(FaultPlan(latency_s=0.05)) as server:
        backend = make_backend("openai:m", base_url=server.url, concurrency=4)

        async def all_of_them() -> list[Any]:
            return await asyncio.gather(
                *(backend.agenerate(Request(config=CFG, prompt=p)) for p in prompts)
            )

        out = asyncio.run(all_of_them())
        assert [c.text for c in out] == [echo_answer(p) for p in prompts]
        assert out[0].sent == backend.generate([Request(config=CFG, prompt=prompts[0])])[0].sent
        events = server.events
        points = sorted(
            [(e.arrived, 1) for e in events] + [(e.answered or 0.0, -1) for e in events]
        )
        depth = peak = 0
        for _, d in points:
            depth += d
            peak = max(peak, depth)
        assert peak <= 4

        async def cancelled_then_another() -> str:
            task = asyncio.ensure_future(backend.agenerate(Request(config=CFG, prompt="slow")))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await backend.agenerate(Request(config=CFG, prompt="next"))).text

        assert asyncio.run(cancelled_then_another()) == echo_answer("next")
        backend.close()

    plan = FaultPlan(rate=1.0, kinds=("endless",), trickle_s=0.05)
    with FaultServer(plan) as server:
        backend = make_backend("openai:m", base_url=server.url, timeout=60, max_retries=3)

        async def blocked() -> BaseException:
            task = asyncio.ensure_future(backend.agenerate(Request(config=CFG, prompt="hi")))
            while not server.events:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await asyncio.get_running_loop().run_in_executor(None, backend.close)
            try:
                await task
            except BaseException as exc:  # noqa: B036 - checked below
                return exc
            raise AssertionError("the request was answered")

        error = asyncio.run(blocked())
    assert isinstance(error, BackendError) and "cancelled" in str(error), repr(error)
