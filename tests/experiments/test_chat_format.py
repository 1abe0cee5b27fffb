"""``--chat-format`` with ``--base-url``: ``user`` and ``prefill`` send the actor's prompts to
the server's chat endpoint wrapped that way (an ``openai:`` model, and a ``vllm:`` model served
by a server of your own), ``raw`` sends them to the completions endpoint as text, and the
manifest records which; a server without a chat endpoint is a one-line error naming the fix.
The server is a real one on loopback (tests/support/fault_server.py) that records what it got."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.llm.common import prompt_as_messages
from experiments.cli import main
from experiments.store import open_reader
from experiments.viewer.data import step_prompt
from memory.records import SentRequest
from tests.support.fault_server import FaultServer

SPLIT = "eval_out_of_distribution"
FAST = ["--backend-option", "max_retries=1", "--backend-option", "backoff_base=0.01",
        "--backend-option", "jitter=0"]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_real_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def _run(server: FaultServer, model: str, run_dir: Path, games: Path, *more: str) -> int:
    return main([
        "run", "--model", model, "--base-url", server.url, "--agent", "react",
        "--data", str(games), "--split", SPLIT, "--games", "1", "--trials", "1",
        "--max-steps", "2", "--workers", "1", "--concurrency", "1", "--run-dir", str(run_dir),
        *FAST, *more,
    ])  # fmt: skip


def _prompts(run_dir: Path) -> tuple[list[SentRequest], dict[str, Any]]:
    """The request of every step the run played, as the store recorded it (what the server
    got), and the manifest's record of the actor."""
    with open_reader(run_dir) as reader:
        out = []
        for row in reader.episodes():
            steps = reader.steps(row.episode_id)
            for k in range(len(steps)):
                prompt = step_prompt(reader, row, steps, k)
                assert not prompt.rebuilt
                out.append(prompt.sent)
        actor = reader.get_meta("manifest")["actor"]
    return out, actor


@pytest.mark.parametrize("model", ["openai:fault-model", "vllm:fault-model"])
@pytest.mark.parametrize("chat_format", ["user", "prefill"])
def test_a_chat_format_sends_chat_requests_wrapped_that_way(
    generated_games: Path, tmp_path: Path, model: str, chat_format: str
) -> None:
    with FaultServer() as server:
        code = _run(server, model, tmp_path / "run", generated_games, "--chat-format", chat_format)
        paths, bodies = server.paths, server.bodies
    assert code == 0
    prompts, actor = _prompts(tmp_path / "run")
    assert len(prompts) == 2
    assert paths == ["/v1/chat/completions"] * 2
    assert [b["messages"] for b in bodies] == [p.chat for p in prompts]  # as recorded
    chats = [p.chat for p in prompts]
    if chat_format == "user":  # the instruction, a blank line, then the prompt
        texts = [m[0]["content"].split("\n\n", 1)[1] for m in chats]
    else:  # the prompt as the assistant's unfinished message
        texts = [m[1]["content"] for m in chats]
    assert [p.chat for p in prompts] == [prompt_as_messages(t, chat_format) for t in texts]
    assert all("prompt" not in b for b in bodies)
    if chat_format == "prefill":  # vLLM's way to continue the assistant's message
        assert all(b["continue_final_message"] is True for b in bodies)
        assert all(b["add_generation_prompt"] is False for b in bodies)
    assert (actor["api"], actor["chat_format"]) == ("chat", chat_format)


@pytest.mark.parametrize("model", ["openai:fault-model", "vllm:fault-model"])
@pytest.mark.parametrize("given", [["--chat-format", "raw"], []])
def test_raw_or_no_chat_format_sends_the_completions_text(
    generated_games: Path, tmp_path: Path, model: str, given: list[str]
) -> None:
    with FaultServer() as server:
        code = _run(server, model, tmp_path / "run", generated_games, *given)
        paths, bodies = server.paths, server.bodies
    assert code == 0
    prompts, actor = _prompts(tmp_path / "run")
    assert paths == ["/v1/completions"] * 2
    assert [b["prompt"] for b in bodies] == [p.prompt for p in prompts]
    assert (actor["api"], actor["chat_format"]) == ("completions", "raw")


def test_a_server_without_a_chat_endpoint_is_one_line_naming_the_fix(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FaultServer(routes=("/completions",)) as server:
        code = _run(
            server, "openai:fault-model", tmp_path / "run", generated_games, "--chat-format", "user"
        )
        paths = server.paths
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("reflexsim: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "/chat/completions" in lines[0] and "--chat-format raw" in lines[0], lines[0]
    assert paths == ["/v1/chat/completions"]  # no silent fall back to /completions, no retries


def test_a_chat_format_that_contradicts_the_endpoint_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agents.llm import make_backend
    from agents.llm.base import SpecError

    url = "http://127.0.0.1:9/v1"
    with pytest.raises(SpecError, match="api=completions sends them as text"):
        make_backend("openai:m", base_url=url, api="completions", chat_format="user")
    with pytest.raises(SpecError, match="api=chat sends chat messages"):
        make_backend("vllm:m", base_url=url, api="chat", chat_format="raw")
    # api.openai.com: chat by default, and raw is its completions endpoint (no request is made)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    for chat_format, api in ((None, "chat"), ("raw", "completions"), ("prefill", "chat")):
        backend = make_backend("openai:m", chat_format=chat_format)
        assert (backend.api, backend.chat_format) == (api, chat_format or "user")
        backend.close()


def test_the_papers_protocol_sends_a_chat_model_the_prompt_alone_as_the_code_does(
    generated_games: Path, tmp_path: Path
) -> None:
    # the code's get_chat: the actor's whole prompt as one user message, nothing added; its
    # sampling: the try's temperature, the token limit, the newline stop
    from tests.agents.test_reflexion_code import files

    flags = [a for k, v in files().items() for a in (f"--{k.replace('_', '-')}", v)]
    with FaultServer() as server:
        code = main([
            "run", "--model", "openai:fault-model", "--base-url", server.url,
            "--chat-format", "user", "--protocol", "reflexion-code", "--evaluator", "code",
            *flags, "--data", str(generated_games), "--split", SPLIT, "--games", "1",
            "--trials", "1", "--max-steps", "2", "--max-tokens", "256", "--workers", "1",
            "--concurrency", "1", "--run-dir", str(tmp_path / "run"), *FAST,
        ])  # fmt: skip
        bodies = server.bodies
    assert code == 0
    prompts, actor = _prompts(tmp_path / "run")
    instruction = Path(files()["instruction_file"]).read_text()
    chats = [p.chat for p in prompts]
    assert chats and all(len(c) == 1 and c[0]["role"] == "user" for c in chats)
    assert all(c[0]["content"].startswith(instruction) for c in chats)  # the prompt alone
    assert all(c[0]["content"].endswith(">") for c in chats)
    acts = [b for b in bodies if b["messages"][0]["content"].startswith(instruction)]
    assert all(b["messages"] in chats for b in acts)  # every try, as recorded
    assert all(b["stop"] == ["\n"] and b["max_tokens"] == 256 for b in acts)
    assert actor["chat_instruction"] == ""
