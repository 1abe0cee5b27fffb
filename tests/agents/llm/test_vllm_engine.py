"""The real vLLM engine (the CPU build) in one ``scripts/backend_stdio.py`` process for the
module: the async engine's batching and prefix cache, grounded decoding on real generated games,
and prompts over max_model_len. Skipped without ``REFLEXSIM_VLLM_PYTHON`` (see
``tests/support/vllm_real.py``); in the slow set."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.llm.base import (
    ActionConstraint,
    BackendError,
    Completion,
    ContextLimitError,
    GenerationConfig,
    Message,
    Request,
)
from agents.prompting import actor_prefix, example_texts
from experiments.store import RunStore
from tests.support.backend_process import BackendProcess
from tests.support.grounded_episodes import NASTY, assert_grounded, play
from tests.support.vllm_real import ENGINE, LONG_INSTRUCTION, VLLM_PYTHON, context_limited

# ---------------------------------------------------------------------------------------------
# Grounded decoding and the async engine on the real CPU build. One vLLM process serves the
# module (scripts/backend_stdio.py); the episodes are played here, on real generated games.


@pytest.fixture(scope="module")
def vllm_stdio(
    vllm_checkpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackendProcess]:
    log = tmp_path_factory.mktemp("vllm") / "stdio.log"
    server = BackendProcess(str(VLLM_PYTHON), f"vllm:{vllm_checkpoint}", ENGINE, log)
    assert server.ready["grounding"] == "vLLM structured outputs (regex)"
    info = server.ready["describe"]
    assert info["vllm_version"] and info["engine"]["enable_prefix_caching"] is True
    yield server
    server.close()


# the actor's instruction and examples: long enough to fill whole KV-cache blocks
SHARED_PREFIX = actor_prefix(example_texts("clean")) + (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a "
    "countertop 1, a drawer 1, a fridge 1, a shelf 1, a sinkbasin 1, and a toilet 1.\n"
)
TASKS = ("put a clean mug in cabinet", "heat an egg", "cool a tomato", "find two keys", "look")


@pytest.mark.slow
def test_real_vllm_async_concurrent_matches_sequential(vllm_stdio: BackendProcess) -> None:
    config = GenerationConfig(temperature=0.0, max_tokens=12, stop=("\n",), seed=0)
    requests = [
        Request(config=config, prompt=f"{SHARED_PREFIX}Your task is to: {task}.\n>")
        for task in TASKS
    ]
    sequential, _ = vllm_stdio.send("sequential", requests)  # one agenerate at a time
    concurrent, _ = vllm_stdio.send("concurrent", requests)  # all at once on one event loop
    batched, _ = vllm_stdio.send("generate", requests)  # the sync API, on the same engine
    texts = [c.text for c in sequential]
    assert [c.text for c in concurrent] == texts == [c.text for c in batched]  # float32 greedy
    for c in (*sequential, *concurrent):
        assert c.prompt_tokens > 0 and 0 < c.completion_tokens <= 12
        assert c.finish_reason in ("stop", "length")
    # the shared prefix is cached: by the first request onwards when sequential, fully after
    assert all(c.cached_tokens > 0 for c in sequential[1:])
    assert all(c.cached_tokens > 0 for c in concurrent)
    # a prompt grown by its action and an observation (the append-only transcript) reuses the
    # cache, and a chat request (a reflection) rides in the same concurrent batch, rendered with
    # the model's own chat template
    grown = dataclasses.replace(
        requests[0], prompt=f"{requests[0].prompt}{texts[0]}\nNothing happens.\n>"
    )
    chat = Request(
        config=dataclasses.replace(config, max_tokens=24, stop=()),
        messages=(Message("user", "You failed the task. In one sentence, write a better plan."),),
        purpose="reflect",
    )
    (longer, reflection), _ = vllm_stdio.send("concurrent", [grown, chat])
    assert longer.prompt_tokens > sequential[0].prompt_tokens
    assert longer.cached_tokens >= concurrent[0].cached_tokens > 0  # what its prefix had
    assert reflection.sent.startswith("<bos><start_of_turn>user\n")
    assert reflection.sent.endswith("<start_of_turn>model\n")
    assert reflection.prompt_tokens > 0 and 0 < reflection.completion_tokens <= 24
    # grounded on the async engine too
    c = ActionConstraint(("go to cabinet 1", "go to shelf 1", "look"), allow_think=False)
    grounded = [dataclasses.replace(r, constraint=c) for r in requests]
    for op in ("concurrent", "generate"):
        answers, _ = vllm_stdio.send(op, grounded)
        assert {a.text for a in answers} <= {" go to cabinet 1", " go to shelf 1", " look"}
    # the regex escapes quotes, backslashes and regex syntax as vLLM's engines read them
    nasty = [
        dataclasses.replace(requests[0], constraint=ActionConstraint(NASTY, allow_think=False))
    ]
    (answer,), _ = vllm_stdio.send("concurrent", nasty)
    assert answer.text[1:] in NASTY


@pytest.mark.slow
def test_real_vllm_grounded_episodes_async(
    vllm_stdio: BackendProcess, generated_games: Path
) -> None:
    steps = play(lambda r: vllm_stdio.send("concurrent", r)[0], generated_games)
    assert_grounded(steps)


class _StdioModel:
    """The vLLM engine of the backend_stdio process (in-process there, ``agenerate`` on its async
    engine) as a run's model: its context-limit errors come back as they were raised."""

    name = "vllm-stdio"

    def __init__(self, server: BackendProcess) -> None:
        self.server = server

    def generate(self, requests: list[Request]) -> list[Completion]:
        answer = self.server.ask("concurrent", requests)
        if "prompt_tokens" in answer:
            raise ContextLimitError(
                answer["error"], prompt_tokens=answer["prompt_tokens"], limit=answer["limit"]
            )
        if "error" in answer:
            raise BackendError(answer["error"])
        return [Completion(**c) for c in answer["completions"]]

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_real_vllm_prompt_over_max_model_len_ends_episodes_as_context_limit(
    vllm_stdio: BackendProcess, generated_games: Path, tmp_path: Path
) -> None:
    """The in-process engine (max_model_len 4096) gets actor prompts of about 5000 tokens (a long
    instruction): vLLM refuses them, the backend raises ContextLimitError with vLLM's token
    count, and each episode ends with the class ``context_limit`` (done, not an error); played
    again over the same store (a resume), none is asked again; the report counts them."""
    from agents.react import ReActAgent
    from agents.reflexion import ReflexionSettings
    from envs.aio import AsyncEnvPool
    from envs.pool import EnvPool, EnvSpec
    from experiments.arming import actor_settings
    from experiments.config import RunConfig
    from experiments.engine import Engine, ModelClient
    from experiments.games import select_games
    from experiments.report import summarize
    from experiments.trials import TrialLoop, TrialPlan

    cfg = RunConfig.of(
        model="scripted:expert", data=str(generated_games), split="eval_out_of_distribution",
        games=2, trials=1, max_steps=3,
    )  # fmt: skip
    games = select_games(cfg)
    store = RunStore(tmp_path / "run", create=True)
    store.set_meta("manifest", {"games": {t.game: t.task_type for t in games.tasks}})
    pool = EnvPool(EnvSpec(games.env_kind, games.env_kwargs), workers=1, timeout_s=120)
    plan = TrialPlan(trials=1, reflexion=ReflexionSettings(3, "x", instruction=LONG_INSTRUCTION))

    async def play() -> str | None:
        engine = Engine(store, ModelClient(_StdioModel(vllm_stdio)), AsyncEnvPool(pool), arm="x")
        agent = ReActAgent(actor_settings(cfg))
        return await TrialLoop(store, engine, agent, plan).run(games.tasks)

    try:
        assert asyncio.run(play()) is None
        calls = len(store.model_calls())
        assert asyncio.run(play()) is None  # a resume: the episodes are done
        assert len(store.model_calls()) == calls
    finally:
        pool.close()
    episodes = store.episodes()
    summary = summarize(store)
    store.close()
    counts = context_limited(episodes, summary, 4096)
    print(f"\nin-process vLLM, max_model_len 4096: (prompt tokens, limit) {counts}")
    assert all(tokens > limit for tokens, limit in counts)
