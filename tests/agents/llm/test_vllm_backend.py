"""vLLM backend: the pure mappings and the batching plumbing, against a stand-in ``vllm`` module
(run anywhere). The real engine on CPU is tested in ``test_vllm_engine.py`` and
``test_vllm_served.py`` (the slow set; they need ``REFLEXSIM_VLLM_PYTHON``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from agents.llm.base import (
    ActionConstraint,
    BackendError,
    CallSite,
    Completion,
    ContextLimitError,
    GenerationConfig,
    Message,
    MissingDependencyError,
    ModelRestarted,
    Request,
    SpecError,
)
from agents.llm.grounding import regex_for
from agents.llm.vllm_backend import (
    VLLMBackend,
    engine_kwargs,
    sampling_params_kwargs,
)
from experiments.store import RunStore

REPO = Path(__file__).resolve().parents[3]

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
        if kwargs.pop("continue_final_message", False):  # the last message stays open
            assert kwargs == {"tokenize": False, "add_generation_prompt": False}
            return "<bos>" + "".join(f"[{m['role']}]{m['content']}" for m in messages)
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
        self.sessions: list[tuple[Any, str | None]] = []  # (prompt, session_id) of each call

    @classmethod
    def from_engine_args(cls, args: _FakeAsyncEngineArgs) -> _FakeAsyncEngine:
        engine = cls(args)
        cls.instances.append(engine)
        return engine

    def get_tokenizer(self) -> _FakeTokenizer:
        return _FakeTokenizer()

    async def generate(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
    ) -> Any:
        """``AsyncLLM.generate`` as vLLM 0.34 has it (its other keywords left out)."""
        self.params.append(params)
        self.prompts.append(prompt)
        self.sessions.append((prompt, session_id))
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


def test_chat_format_wraps_prompts_in_the_models_chat_template(
    fake_vllm: types.ModuleType,
) -> None:
    """``--chat-format user|prefill`` with an in-process model: the prompt becomes chat messages
    rendered by the model's own template (it used to be an unknown engine option)."""
    from agents.llm import make_backend

    prompt = Request(config=GenerationConfig(), prompt="You are in a room.\n>")
    raw = VLLMBackend("m")
    assert raw.generate([prompt])[0].sent == prompt.prompt  # the default: the text as it is
    user = make_backend("vllm:m", chat_format="user", chat_instruction="Go on.")
    (out,) = user.generate([prompt])
    assert out.sent == "<bos>[user]Go on.\n\nYou are in a room.\n>[model]"
    prefill = VLLMBackend("m", chat_format="prefill", chat_instruction="Go on.")
    assert prefill.describe()["chat_format"] == "prefill"
    (out,) = prefill.generate([prompt])
    assert out.sent == "<bos>[user]Go on.[assistant]You are in a room.\n>"
    ids = _FakeLLM.instances[-1].calls[0][0][0]["prompt_token_ids"]
    assert ids == list(range(3))  # sent as the template's tokens (the stand-in counts "]")
    with pytest.raises(SpecError, match="chat_format='assistant' is not one of raw, user"):
        VLLMBackend("m", chat_format="assistant")


def test_swap_space_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(SpecError, match="vllm option swap_space: .*drop it"):
        engine_kwargs("m", swap_space=4)


def test_the_async_engine_is_asked_for_final_outputs_only(
    fake_vllm: types.ModuleType,
) -> None:
    import enum

    class RequestOutputKind(enum.Enum):  # as vllm.sampling_params has it
        CUMULATIVE = 0
        DELTA = 1
        FINAL_ONLY = 2

    fake_vllm.RequestOutputKind = RequestOutputKind  # type: ignore[attr-defined]
    backend = VLLMBackend("m")
    request = Request(config=GenerationConfig(), prompt="p>")
    assert asyncio.run(backend.agenerate(request)).text == " echo p>"
    (engine,) = _FakeAsyncEngine.instances
    assert engine.params[0].kwargs["output_kind"] is RequestOutputKind.FINAL_ONLY
    backend.close()


def test_engine_processes_are_spawned_unless_the_user_chose(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM forks its engine process by default, from a runner that already has threads."""
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    VLLMBackend("m")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    VLLMBackend("m")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_the_engine_record_says_which_sampling_defaults_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agents.llm.vllm_backend import engine_record

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert engine_record("openai:gpt-4o", None, False, None) is None
    inproc = engine_record("vllm:m", None, False, None)
    assert inproc is not None
    assert inproc["engine"] == "in-process" and inproc["generation_config"] == "vllm"
    assert inproc["batch_invariant"] is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    url = "http://127.0.0.1:9/v1"  # nothing answers: no version
    served = engine_record("vllm:m", url, True, None)  # the default command
    assert served == {
        "engine": "served", "generation_config": "vllm", "batch_invariant": False,
        "vllm_version": None, "override_generation_config": None,
    }  # fmt: skip
    own = engine_record("vllm:m", url, True, "vllm serve {model} --port {port}")
    assert own is not None and own["generation_config"] == "auto"  # vLLM's default
    other = engine_record("vllm:m", url, False, None)  # a server this run did not start
    assert other is not None and other["generation_config"] is None
    assert other["batch_invariant"] is None


class EngineDeadError(Exception):
    """Named as vLLM names the error of an engine whose core process died."""


def test_a_dead_engine_is_rebuilt_once_per_death_up_to_the_cap(fake_vllm: types.ModuleType) -> None:
    """The requests a dead engine held fail with ModelRestarted and one new engine is built,
    however many of them there were; past ``max_rebuilds`` they are infrastructure errors."""

    async def dies(self: Any, prompt: Any, params: Any, request_id: str) -> Any:
        raise EngineDeadError("EngineCore encountered an issue")
        yield  # an async generator, like the engine's own

    backend = VLLMBackend("m", max_rebuilds=1)
    _FakeAsyncEngine.expected = 3
    requests = [Request(config=GenerationConfig(), prompt=f"p{i}") for i in range(3)]

    async def together() -> list[Any]:
        return list(
            await asyncio.gather(*(backend.agenerate(r) for r in requests), return_exceptions=True)
        )

    try:
        assert all(isinstance(c, Completion) for c in asyncio.run(together()))
        first = _FakeAsyncEngine.instances[0]
        first.generate = types.MethodType(dies, first)  # type: ignore[method-assign]
        failed = asyncio.run(together())
        assert all(isinstance(e, ModelRestarted) for e in failed)
        assert backend.rebuilds == 1 and first.closed and len(_FakeAsyncEngine.instances) == 1
        assert all(isinstance(c, Completion) for c in asyncio.run(together()))  # a new engine
        second = _FakeAsyncEngine.instances[1]
        second.generate = types.MethodType(dies, second)  # type: ignore[method-assign]
        last = asyncio.run(together())
        assert all(type(e) is BackendError and "max_rebuilds=1" in str(e) for e in last)
        assert len(_FakeAsyncEngine.instances) == 2 and second.closed
    finally:
        backend.close()


def test_a_prompt_over_max_model_len_is_a_context_limit(fake_vllm: types.ModuleType) -> None:
    async def too_long(self: Any, prompt: Any, params: Any, request_id: str) -> Any:
        raise ValueError(
            "The decoder prompt (length 5000) is longer than the maximum model length of 4096."
        )
        yield

    backend = VLLMBackend("m")
    try:
        backend.load_async()
        engine = _FakeAsyncEngine.instances[0]
        engine.generate = types.MethodType(too_long, engine)  # type: ignore[method-assign]
        with pytest.raises(ContextLimitError) as caught:
            asyncio.run(backend.agenerate(Request(config=GenerationConfig(), prompt="p" * 5000)))
        # the prompt's own count (the tokenizer's), not vLLM's, which stops at the limit
        assert caught.value.prompt_tokens > caught.value.limit == 4096
        assert backend.rebuilds == 0 and not engine.closed  # the engine is fine
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------
# The real engine on CPU


def test_the_runner_hands_every_request_to_the_async_engine(
    fake_vllm: types.ModuleType, generated_games: Path, tmp_path: Path
) -> None:
    """An in-process ``vllm:`` model in a real run: the engine sends every pending request to
    vLLM's async engine (continuous batching), never the one-batch-at-a-time path. The real
    engine's async path is checked below (one event loop, concurrent requests) and the real
    runner against real vLLM through ``--serve``."""
    from experiments.config import RunConfig
    from experiments.session import run

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


def test_each_episode_sends_its_own_session_id_to_the_async_engine(
    fake_vllm: types.ModuleType, generated_games: Path, tmp_path: Path
) -> None:
    """A Reflexion run on the async engine: every actor call of an episode carries the same
    ``session_id`` (the episode's id), each episode its own, and the reflections, prompts of
    their own, none. Each session's prompts are one growing prompt, so an engine or a router
    that keeps a session together keeps the episode's KV cache together."""
    from experiments.config import RunConfig
    from experiments.session import run

    run_dir = tmp_path / "run"
    cfg = RunConfig.of(
        model="vllm:m", agent="reflexion", data=str(generated_games),
        split="eval_out_of_distribution", games=2, trials=2, max_steps=3, concurrency=2,
        workers=1, run_dir=str(run_dir),
    )  # fmt: skip
    store = RunStore(run(cfg), readonly=True)
    try:
        episodes = {e.episode_id for e in store.episodes()}
        calls = store.calls_by_purpose()
    finally:
        store.close()
    (engine,) = _FakeAsyncEngine.instances
    by_session: dict[str | None, list[str]] = {}
    for prompt, session in engine.sessions:
        by_session.setdefault(session, []).append(prompt["prompt"])
    assert len(episodes) == 4 and set(by_session) - {None} == episodes
    assert len(by_session[None]) == calls["reflect"].calls > 0
    for session in episodes:
        prompts = by_session[session]
        assert len(prompts) == 3  # every step of the episode
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(prompts))


def test_an_engine_without_session_ids_gets_none(fake_vllm: types.ModuleType) -> None:
    """vLLM releases whose ``AsyncLLM.generate`` has no ``session_id`` get the call they take
    (read once, from the signature, when the backend is built)."""

    class OlderEngine(_FakeAsyncEngine):
        async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:  # type: ignore[override]
            async for output in super().generate(prompt, params, request_id):
                yield output

    request = Request(config=GenerationConfig(), prompt="p>", site=CallSite(episode="g#t0"))
    assert request.session == "g#t0"
    fake_vllm.AsyncLLMEngine = OlderEngine  # type: ignore[attr-defined]
    backend = VLLMBackend("m")
    try:
        assert asyncio.run(backend.agenerate(request)).text == " echo p>"
        assert backend.describe()["session_ids"] is False
    finally:
        backend.close()
    fake_vllm.AsyncLLMEngine = _FakeAsyncEngine  # type: ignore[attr-defined]
    backend = VLLMBackend("m")
    try:
        asyncio.run(backend.agenerate(request))
        assert backend.describe()["session_ids"] is True
    finally:
        backend.close()
    assert [sessions for engine in _FakeAsyncEngine.instances for sessions in engine.sessions] == [
        ({"prompt_token_ids": [256, *b"p>"], "prompt": "p>"}, None),
        ({"prompt_token_ids": [256, *b"p>"], "prompt": "p>"}, "g#t0"),
    ]
