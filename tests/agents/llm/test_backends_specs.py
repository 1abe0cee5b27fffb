"""Model specs: every prefix parses, bad specs and options fail in one clear line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from agents.llm import MissingDependencyError, SpecError, make_backend, parse_spec
from agents.llm.common import safe_url, scrub, truncate_at_stop
from agents.llm.specs import PREFIXES, ModelSpec

ROOT = Path(__file__).resolve().parent.parent.parent.parent


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("vllm:Qwen/Qwen2.5-14B-Instruct", ModelSpec("vllm", "Qwen/Qwen2.5-14B-Instruct")),
        ("openai:gpt-4o-mini", ModelSpec("openai", "gpt-4o-mini")),
        ("anthropic:claude-sonnet-4-5", ModelSpec("anthropic", "claude-sonnet-4-5")),
        ("hf:/models/my-checkpoint", ModelSpec("hf", "/models/my-checkpoint")),
        ("llamacpp:/tmp/m.gguf", ModelSpec("llamacpp", "/tmp/m.gguf")),
        ("embedded", ModelSpec("embedded", "gemma3-270m")),
        ("embedded:smollm2-135m", ModelSpec("embedded", "smollm2-135m")),
        ("scripted:expert", ModelSpec("scripted", "expert")),
        ("scripted:replay:runs/a:b", ModelSpec("scripted", "replay:runs/a:b")),
        ("  OpenAI:gpt-4o ", ModelSpec("openai", "gpt-4o")),
    ],
)
def test_every_prefix_parses(spec: str, expected: ModelSpec) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    "spec",
    ["gpt4", "foo:bar", "", "openai:", "embedded:llama-70b", "scripted:genius", "scripted:replay"],
)
def test_bad_specs_are_one_line_spec_errors(spec: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    message = str(info.value)
    assert "\n" not in message
    assert spec.strip() == "" or spec.split(":")[0] in message or "embedded" in message


def test_unknown_spec_lists_the_valid_prefixes() -> None:
    with pytest.raises(SpecError) as info:
        make_backend("gpt-4:o")
    for prefix in PREFIXES:
        assert prefix in str(info.value)


def test_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(SpecError, match=r"unknown option\(s\) temprature .*valid: .*arm"):
        make_backend("scripted:expert", temprature=0.5)


def test_option_values_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SpecError, match="concurrency='many' must be an integer"):
        make_backend("openai:x", base_url="http://127.0.0.1:9/v1", concurrency="many")
    with pytest.raises(SpecError, match="chat_format='json'"):
        make_backend("openai:x", base_url="http://127.0.0.1:9/v1", chat_format="json")
    backend = make_backend("openai:x", base_url="http://127.0.0.1:9/v1", concurrency="3")
    assert backend.describe()["concurrency"] == 3
    backend.close()


def test_hosted_api_without_key_says_which_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(SpecError, match="set the OPENAI_API_KEY environment variable"):
        make_backend("openai:gpt-4o")
    with pytest.raises(SpecError, match="ANTHROPIC_API_KEY"):
        make_backend("anthropic:claude-haiku-4-5")


@pytest.mark.parametrize(
    ("spec", "module", "extra"),
    [
        ("openai:gpt-4o", "aiohttp", "openai"),
        ("anthropic:claude-haiku-4-5", "anthropic", "anthropic"),
        ("hf:gpt2", "transformers", "hf"),
        ("llamacpp:{gguf}", "llama_cpp", "server"),
    ],
)
def test_missing_dependency_names_the_extra(
    spec: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for name in (module, "torch") if extra == "hf" else (module,):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    with pytest.raises(MissingDependencyError) as info:
        make_backend(spec.format(gguf=gguf))
    assert f"pip install reflexsim[{extra}]" in str(info.value)
    assert info.value.extra == extra


def test_vllm_is_routed_lazily_to_its_module() -> None:
    # without vllm installed, the vLLM backend must say which extra to install
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match=r"reflexsim\[vllm\]"):
            make_backend("vllm:facebook/opt-125m")
    else:
        pytest.skip("vllm is installed; building it would load a model")


def test_import_agents_llm_stays_light() -> None:
    code = (
        "import sys, agents.llm, agents.llm.specs, agents.llm.pricing, agents.llm.scripted\n"
        "heavy = {'openai', 'anthropic', 'llama_cpp', 'torch', 'transformers', 'vllm', 'aiohttp'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_backend_modules_import_only_memory_and_agents() -> None:
    project = {"envs", "experiments"}
    for path in (ROOT / "agents" / "llm").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in project, f"{path.name} imports {name}"


def test_stop_truncation_cuts_at_the_earliest_stop() -> None:
    assert truncate_at_stop(" go to desk 1\n> look", ["\n"]) == (" go to desk 1", True)
    assert truncate_at_stop("abc STOP def\nx", ["\n", "STOP"]) == ("abc ", True)
    assert truncate_at_stop("no stop here", ["\n", ""]) == ("no stop here", False)
    assert truncate_at_stop("", ["\n"]) == ("", False)


def test_base_url_from_the_environment_is_what_describe_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    backend = make_backend("openai:local")
    info = backend.describe()
    assert info["base_url"] == "http://127.0.0.1:9/v1" and info["api"] == "completions"
    assert "sk-" not in repr(vars(backend))
    backend.close()


def test_safe_url_and_scrub_drop_secrets() -> None:
    assert safe_url("http://user:pw@host:8000/v1?key=abc#x") == "http://host:8000/v1"
    key = "sk-canary-0123456789abcdef"
    text = f"Incorrect API key provided: {key}; masked sk-canary-01...cdef"
    cleaned = scrub(text, [key])
    assert key not in cleaned and "sk-canary-01" not in cleaned


def test_a_request_survives_the_trip_to_a_backend_in_another_process():
    import json

    from agents.llm.base import ActionConstraint, CallSite, GenerationConfig, Message, Request

    config = GenerationConfig(temperature=0.7, max_tokens=12, stop=("\n", ">"), seed=None, n=3)
    requests = [
        Request(
            config=config,
            prompt="You are in the middle of a room. >",
            site=CallSite(
                episode="e1",
                game="g",
                trial=1,
                step=2,
                history=("look",),
                admissible=("look", "go to desk 1"),
            ),
        ),  # fmt: skip
        Request(
            config=GenerationConfig(),
            messages=(Message("system", "Be brief."), Message("user", "<b>look</b> ü")),
            purpose="reflect",
            constraint=ActionConstraint(("go to desk 1", "look"), allow_think=False, lead=""),
        ),
    ]
    for request in requests:
        back = Request.from_json(json.loads(json.dumps(request.to_json())))
        assert back == request and back.site == request.site  # typed: it makes the trip whole


def test_a_request_holds_typed_records_only():
    """No untyped mapping rides on a request: every field of a Request and of its call site is
    a typed value or record."""
    import typing

    from agents.llm.base import CallSite, Request

    for record in (Request, CallSite):
        for name, hint in typing.get_type_hints(record).items():
            text = str(hint)
            assert not any(w in text for w in ("dict", "Mapping", "Any")), (record, name, text)
