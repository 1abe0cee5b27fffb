"""Model-side faults of a run: a prompt over the model's context (llama.cpp, an OpenAI-style API),
a model engine that died and was rebuilt, the errors of every attempt, the device share of
several in-process models. The real vLLM cases are in tests/agents/llm/test_vllm_served.py."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from agents.llm import make_backend
from agents.llm.base import Completion, ContextLimitError, ModelRestarted, Request
from agents.llm.common import context_limit_error
from experiments.arming import check_device_share, own_models
from experiments.config import RunConfig
from experiments.engine import context_verdict
from experiments.report import markdown_report, summarize
from experiments.session import run
from experiments.store import RunStore, open_reader
from experiments.viewer.data import episode_detail
from tests.support.fault_server import FaultPlan, FaultServer

SPLIT = "eval_out_of_distribution"


# -- how engines and servers say it ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("message", "code", "tokens", "limit"),
    [
        (  # OpenAI
            "Error code: 400 - This model's maximum context length is 8192 tokens. However, your "
            "messages resulted in 9001 tokens. Please reduce the length of the messages.",
            "context_length_exceeded", 9001, 8192,
        ),
        (  # vLLM's engine (0.32 input processor)
            "The decoder prompt (length 5000) is longer than the maximum model length of 4096. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
            None, 5000, 4096,
        ),
        (  # vLLM's renderer / server
            "This model's maximum context length is 512 tokens. However, your prompt contains at "
            "least 513 input tokens, which exceeds this limit even without any output tokens.",
            None, 513, 512,
        ),
        ("prompt is too long: 210000 tokens > 200000 maximum", None, 210000, 200000),  # Anthropic
        ("the limit was passed", "context_length_exceeded", None, None),  # the code alone
    ],
)  # fmt: skip
def test_context_limit_wordings(
    message: str, code: str | None, tokens: int | None, limit: int | None
) -> None:
    error = context_limit_error(message, code, "m")
    assert isinstance(error, ContextLimitError)
    assert (error.prompt_tokens, error.limit) == (tokens, limit)
    assert error.exact == ("at least" not in message)  # vLLM's server stops counting there
    assert context_verdict(error).startswith(
        f"prompt of {'' if error.exact else 'at least '}{tokens if tokens else '?'} tokens"
    )


@pytest.mark.parametrize("message", ["Error code: 500 - overloaded", "rate limit", ""])
def test_other_errors_are_not_context_limits(message: str) -> None:
    assert context_limit_error(message, "server_error") is None


# -- an episode over the context: a failure class of its own, never retried ------------------------
def _look(prompt: str) -> str:
    return " look"


def _context_rows(run_dir: Path) -> list[tuple[str, int, int, str]]:
    reader = open_reader(run_dir)
    try:
        return [
            (e.episode_id, e.attempts, len(reader.steps(e.episode_id)), e.verdict or "")
            for e in reader.episodes()
            if e.failure_class == "context_limit"
        ]
    finally:
        reader.close()


def _assert_counted_and_kept(run_dir: Path, cfg: RunConfig, limited: int) -> dict[str, int]:
    """Every context-limited episode is done (not an error), the report counts them, and a
    --resume plays none of them again (no model call). The report's numbers."""
    reader = open_reader(run_dir)
    try:
        summary = summarize(reader)
        calls = len(reader.model_calls())
        assert summary.errors == 0 and summary.status.complete
        assert summary.failure_classes["context_limit"] == limited
        assert len(reader.events("context_limit")) == limited
    finally:
        reader.close()
    assert "| context_limit | " in markdown_report([summary], ["run"], [], [])
    before = _context_rows(run_dir)
    run(cfg, resume=str(run_dir))
    after = open_reader(run_dir)
    try:
        assert len(after.model_calls()) == calls  # nothing was asked again
    finally:
        after.close()
    assert _context_rows(run_dir) == before and all(a == 1 for _, a, _, _ in before)
    return {"episodes": len(before), "calls": calls}


def test_api_context_length_exceeded_ends_the_episode_as_context_limit(
    generated_games: Path, tmp_path: Path
) -> None:
    """A real local HTTP server answers OpenAI's 400 ``context_length_exceeded`` once a prompt
    outgrows its context: the episode ends there (its earlier steps kept) with the class
    ``context_limit`` and the prompt's token count, is never an infrastructure error, is not
    played again on --resume, and the report counts it."""

    def cfg(url: str, name: str) -> RunConfig:
        return RunConfig.of(
            model="openai:test", base_url=url, data=str(generated_games), split=SPLIT, trials=1,
            games=3, max_steps=4, workers=1, concurrency=3, run_dir=str(tmp_path / name),
            backend_options={"max_retries": 2, "timeout": 5, "backoff_base": 0.01},
        )  # fmt: skip

    with FaultServer(FaultPlan(), answer=_look) as server:
        clean = run(cfg(server.url, "clean"))
    reader = open_reader(clean)
    firsts = [reader.steps(e.episode_id)[0].prompt_tokens for e in reader.episodes()]
    reader.close()
    limit = max(firsts)  # every first prompt fits; a longer one does not
    with FaultServer(FaultPlan(context_words=limit), answer=_look) as server:
        config = cfg(server.url, "limited")
        run_dir = run(config)
        rows = _context_rows(run_dir)
        assert rows and server.stats()["context"] == len(rows)
        for _, _, steps, verdict in rows:
            tokens, context = map(int, re.findall(r"\d+", verdict))
            assert steps >= 1 and tokens > limit and context == limit
        numbers = _assert_counted_and_kept(run_dir, config, len(rows))
        assert server.stats()["context"] == len(rows)  # the resume sent none of them again
    print(f"\ncontext {limit} words: {len(rows)} episodes ended at the limit ({numbers}): {rows}")


@pytest.mark.parametrize("evaluator", ["paper", "llm"])
def test_a_reflection_over_the_context_is_skipped_and_the_task_goes_on(
    generated_games: Path, tmp_path: Path, evaluator: str
) -> None:
    """The reflector (a real local HTTP server with a 40-word context) refuses every reflection
    prompt, and the LLM evaluator's judge prompt, as over its context: no reflection is kept, a
    judge that could not read is 'unclear', the events say so, and the task plays its next
    trials with the memory it had (the learner, shown none, fails them); the run completes with
    no infrastructure error and a --resume asks nothing again."""
    with FaultServer(FaultPlan(context_words=40), answer=_look) as server:
        cfg = RunConfig.of(
            model="scripted:learner", reflect_model="openai:test", data=str(generated_games),
            split=SPLIT, trials=3, games=2, max_steps=4, workers=1, concurrency=2,
            run_dir=str(tmp_path / "run"), evaluator=evaluator,
            role_options={"reflect": {"base_url": server.url, "max_retries": 2, "timeout": 5}},
        )  # fmt: skip
        run_dir = run(cfg)
        asked = server.stats()["context"]
        with open_reader(run_dir) as reader:
            summary = summarize(reader)
            assert summary.status.complete and summary.errors == 0
            assert [t.tasks_run for t in summary.trials] == [2, 2, 2]
            assert reader.reflections() == []
            details = [e["detail"] for e in reader.events("context_limit")]
            judged = {e.judge_verdict for e in reader.episodes()}
        reflections = [d for d in details if d.startswith("reflection not made (trial")]
        judges = [d for d in details if d.startswith("judge of trial")]
        assert len(reflections) == 4  # two games, a reflection after trials 0 and 1
        assert len(judges) == (6 if evaluator == "llm" else 0)  # every episode judged
        assert asked == len(details) and all("exceeds" in d for d in details)
        assert judged == ({"unclear"} if evaluator == "llm" else {None})
        run(cfg, resume=str(run_dir))
        assert server.stats()["context"] == asked


def test_llamacpp_prompt_over_n_ctx_ends_the_episode_as_context_limit(
    generated_games: Path, tmp_path: Path
) -> None:
    """The embedded model at n_ctx=512: no ALFWorld prompt fits, so every episode ends at its
    first request with the class ``context_limit`` and the prompt's token count."""
    cfg = RunConfig.of(
        model="embedded", backend_options={"n_ctx": 512, "n_threads": 1}, data=str(generated_games),
        split=SPLIT, games=2, trials=1, max_steps=3, run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    run_dir = run(cfg)
    rows = _context_rows(run_dir)
    assert len(rows) == 2
    for _, _, steps, verdict in rows:
        tokens, context = map(int, re.findall(r"\d+", verdict))
        assert steps == 0 and tokens >= 512 and context == 512
    _assert_counted_and_kept(run_dir, cfg, 2)
    print(f"\nllama.cpp n_ctx=512: {rows}")


# -- every attempt's error, with its traceback -------------------------------------------------------
def test_an_infrastructure_error_keeps_its_traceback_and_a_retry_keeps_it(
    generated_games: Path, tmp_path: Path
) -> None:
    """One task's requests fail: its episode's error keeps the whole traceback; --resume against
    a healthy server plays it again (attempt 2) and the first attempt's error stays, in the
    store, the report and the viewer's episode page."""
    plan = FaultPlan(always_fail="Your task is to: heat")
    with FaultServer(plan, answer=_look) as server:
        port = server.port
        cfg = RunConfig.of(
            model="openai:test", base_url=server.url, data=str(generated_games), split=SPLIT,
            task_types=("heat", "cool"), trials=1, max_steps=3, run_dir=str(tmp_path / "run"),
            backend_options={"max_retries": 0, "timeout": 5},
        )  # fmt: skip
        run_dir = run(cfg)
    reader = open_reader(run_dir)
    (failed,) = [e for e in reader.episodes() if e.status == "error"]
    (error,) = reader.episode_errors(failed.episode_id)
    reader.close()
    assert error.attempt == 1 and error.kind == "infra_error" and error.error == failed.error
    assert error.traceback.startswith("Traceback") and "BackendError" in error.traceback
    with FaultServer(FaultPlan(), answer=_look, port=port):
        run(cfg, resume=str(run_dir))
    reader = open_reader(run_dir)
    try:
        again = reader.episode(failed.episode_id)
        assert again is not None and again.status == "done" and again.attempts == 2
        assert again.error is None and reader.episode_errors(failed.episode_id) == [error]
        page = episode_detail(reader, again, reader.steps(again.episode_id))
        summary = summarize(reader)
    finally:
        reader.close()
    assert page["attempt_errors"] == [
        {"attempt": 1, "kind": "infra_error", "error": error.error, "traceback": error.traceback}
    ]
    text = markdown_report([summary], ["run"], [], [])
    assert "### Harness errors" in text and f"| {failed.episode_id} | 1 | infra_error |" in text


# -- a model engine rebuilt under a run -----------------------------------------------------------
class _DyingEngine:
    """Scripted expert text; the first request after ``after`` answers fails as if the model's
    engine had died and been rebuilt (what the vLLM backend raises then)."""

    name = "dying"

    def __init__(self, truth: object, after: int) -> None:
        self.inner = make_backend("scripted:expert", ground_truth=truth)
        self.after = after
        self.answered = 0

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        if self.answered >= self.after and self.after >= 0:
            self.after = -1
            raise ModelRestarted("the engine died and was rebuilt")
        self.answered += len(requests)
        return self.inner.generate(requests)

    def close(self) -> None:
        self.inner.close()


def test_episodes_in_flight_when_the_engine_died_are_played_again(
    generated_games: Path, tmp_path: Path
) -> None:
    from agents.react import ReActAgent
    from agents.reflexion import ReflexionSettings
    from envs.aio import AsyncEnvPool
    from envs.pool import EnvPool, EnvSpec
    from experiments.arming import actor_settings
    from experiments.engine import Engine, ModelClient
    from experiments.games import select_games
    from experiments.trials import TrialLoop, TrialPlan

    cfg = RunConfig.of(model="scripted:expert", data=str(generated_games), split=SPLIT, games=2)
    games = select_games(cfg)
    store = RunStore(tmp_path / "run", create=True)
    pool = EnvPool(EnvSpec(games.env_kind, games.env_kwargs), workers=1, timeout_s=60)

    async def play() -> str | None:
        backend = _DyingEngine(games.ground_truth, after=3)
        engine = Engine(store, ModelClient(backend), AsyncEnvPool(pool), arm="react")
        plan = TrialPlan(trials=1, reflexion=ReflexionSettings(3, "x"))
        agent = ReActAgent(actor_settings(cfg))
        return await TrialLoop(store, engine, agent, plan).run(games.tasks)

    try:
        assert asyncio.run(play()) is None
    finally:
        pool.close()
    episodes = store.episodes()
    assert len(episodes) == 2 and all(e.status == "done" and e.won for e in episodes)
    again = [e for e in episodes if e.attempts == 2]
    assert again and len(store.events("engine_restart")) == len(again)
    errors = store.episode_errors()
    assert [(e.episode_id, e.attempt, e.kind) for e in errors] == [
        (e.episode_id, 1, "engine_restart") for e in again
    ]
    assert all("ModelRestarted" in e.traceback for e in errors)
    store.close()


# -- several in-process models on one device --------------------------------------------------------
def test_role_options_give_a_role_its_own_backend() -> None:
    same = RunConfig.of(model="vllm:m", reflect_model="vllm:m")
    assert set(own_models(same)) == {"actor"}  # one engine serves both roles
    own = same.replace(role_options={"reflect.gpu_memory_utilization": 0.3})
    assert set(own_models(own)) == {"actor", "reflect"}
    check_device_share(own.replace(role_options={**own.models.role_options, "actor.gpu_memory_utilization": 0.6}))  # fmt: skip


def test_an_overcommitted_device_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    """Two in-process vLLM models whose shares add up to more than the device: exit 2 with one
    line naming each key, before the run directory exists."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    argv = [
        sys.executable, str(Path(__file__).resolve().parents[2] / "run_alfworld.py"),
        "--model", "vllm:m", "--reflect-model", "vllm:m2", "--role-option",
        "reflect.gpu_memory_utilization=0.3", "--run-dir", str(run_dir),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "actor's default gpu_memory_utilization=0.9" in lines[0]
    assert "role_options reflect.gpu_memory_utilization=0.3" in lines[0] and "1.2 > 1.0" in lines[0]
    assert not run_dir.exists()


def test_a_context_limit_is_the_request_s_own_not_a_failover_between_shards() -> None:
    from agents.llm.base import GenerationConfig

    plan = FaultPlan(context_words=3)
    with FaultServer(plan) as a, FaultServer(plan) as b:
        backend = make_backend("openai:test", base_url=f"{a.url},{b.url}", max_retries=0)
        try:
            with pytest.raises(ContextLimitError) as caught:
                backend.generate([Request(config=GenerationConfig(), prompt="one two three four")])
        finally:
            backend.close()
        asked = a.stats().get("context", 0) + b.stats().get("context", 0)
    assert (caught.value.prompt_tokens, caught.value.limit, asked) == (4, 3, 1)
