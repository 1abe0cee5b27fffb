"""The run's record holds what was sent: for every registered arm, each protocol it plays and
``--chat-format`` off and on, a real run (generated ALFWorld games, a scripted policy, a
recording backend between the engine and the policy) records every request byte for byte as the
backend sent it, and the viewer's step prompt and the SFT export's turns are that record."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agents import arms
from agents.llm.base import Completion, Request
from agents.llm.common import CONTINUE_INSTRUCTION, prompt_as_messages
from agents.memory_policy import NO_MEMORY
from experiments import runner
from experiments.replay import replay
from experiments.session import run
from experiments.store import open_reader
from experiments.training_data import joined, sft_records
from experiments.viewer.data import load_episode, step_prompt
from memory.records import SentRequest
from tests.agents.test_reflexion_code import files as code_files
from tests.support.gameruns import game_run

CODE = "reflexion-code"
CASES = [
    (arm, protocol, chat)
    for arm in arms.names()
    for protocol in ("reflexsim", CODE)
    if protocol != CODE or arms.get(arm).code_protocol
    for chat in (None, "user")
]
OWN = {"lats": {"lats_iterations": 2, "lats_n": 2}, "lats+reflexion": {"lats_iterations": 2}}


@pytest.fixture(scope="module")
def gathered(train_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished Reflexion run on train games: the experience the experience arms are shown."""
    cfg = game_run(
        train_games, tmp_path_factory.mktemp("gather"), "gather", "reflexion", split="train",
        trials=2, model="scripted:learner", max_steps=8, task_types=["heat"], workers=1,
        step_timeout_s=600,
    )  # fmt: skip
    return run(cfg)


class Recorder:
    """A backend between the engine and the policy: keeps every request it received and the
    answer that went back."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[tuple[Request, Completion]] = []

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        answers = self.inner.generate(requests)
        self.seen += list(zip(requests, answers, strict=True))
        return answers

    def close(self) -> None:
        self.inner.close()


def _as_received(
    request: Request, answer: Completion, chat: str | None, protocol: str
) -> SentRequest:
    """What the policy was sent, from the request it received: the prompt, or the messages a
    chat model gets for it (and the policy said it sent exactly that). Under the paper's
    protocol a chat model gets the prompt alone as one user message, as the code's get_chat
    sends it."""
    assert request.prompt is not None
    if chat is None:
        assert answer.sent["prompt"] == request.prompt
        return SentRequest(prompt=request.prompt)
    if protocol == CODE:
        messages = [{"role": "user", "content": request.prompt}]
    else:
        messages = prompt_as_messages(request.prompt, chat)
        assert messages[0]["content"].startswith(CONTINUE_INSTRUCTION)
    assert answer.sent["messages"] == messages
    return SentRequest(messages=tuple((m["role"], m["content"]) for m in messages))


@pytest.mark.parametrize(("arm", "protocol", "chat"), CASES)
def test_every_request_is_recorded_as_sent_and_read_back_as_recorded(
    generated_games: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    arm: str,
    protocol: str,
    chat: str | None,
) -> None:
    recorders: list[Recorder] = []
    real = runner.make_backends

    def recording(cfg: Any, truth: Any) -> tuple[Recorder, Recorder]:
        actor, reflector = real(cfg, truth)
        assert reflector is actor
        recorders.append(Recorder(actor))
        return recorders[-1], recorders[-1]

    monkeypatch.setattr(runner, "make_backends", recording)
    kw: dict[str, Any] = dict(OWN.get(arm, {}))
    if protocol == CODE:
        kw.update(protocol=CODE, evaluator="code", **code_files())
    if chat is not None:
        kw["chat_format"] = chat
    if arm in ("insights", "retrieve", "expel"):
        kw["experience_from"] = str(request.getfixturevalue("gathered"))
        recorders.clear()
    # the learner fails its first trial and wins the next with a reflection in its prompt; an
    # arm that keeps no memory plays the expert (a won episode to export)
    alone = arms.get(arm).memory is NO_MEMORY
    cfg = game_run(
        generated_games, tmp_path, "run", arm, trials=1 if alone else 2,
        model="scripted:expert" if alone else "scripted:learner",
        max_steps=12, task_types=["heat"], workers=1, concurrency=1, step_timeout_s=600, **kw,
    )  # fmt: skip
    run_dir = run(cfg)
    seen = [pair for r in recorders for pair in r.seen]
    extracted = [(q, a) for q, a in seen if q.purpose == "insights"]
    seen = [(q, a) for q, a in seen if q.purpose != "insights"]
    assert seen
    if extracted:  # rule extraction: kept, prompt and answer, in the gathering run's record
        with open_reader(kw["experience_from"]) as source:
            kept = [(s["prompt"], s["answer"]) for s in source.get_meta("insights")["steps"]]
        assert [(q.prompt, a.text) for q, a in extracted] == kept

    with open_reader(run_dir) as reader:
        calls = reader.model_calls()
        # every request the backend received is a recorded call, byte for byte, with its answer
        assert [c.sent for c in calls if c.sent is not None] == [c.sent for c in calls]
        assert [(c.sent.prompt, c.sent.messages, c.answer) for c in calls] == [  # type: ignore[union-attr]
            (sent.prompt, sent.messages, answer.text)
            for sent, answer in (
                (_as_received(asked, answer, chat, protocol), answer) for asked, answer in seen
            )
        ]
        assert all(c.sent.params["sampling"] for c in calls)  # type: ignore[union-attr]
        by_site: dict[tuple[str | None, int | None], list[tuple[SentRequest, str]]] = {}
        for asked, answer in seen:
            key = (asked.site.episode, asked.site.step)
            for text in (answer.text, *answer.alternatives):
                by_site.setdefault(key, []).append(
                    (_as_received(asked, answer, chat, protocol), text)
                )
        checked = 0
        for row in reader.episodes():
            steps = reader.steps(row.episode_id)
            detail = load_episode(reader, row.episode_id)
            assert detail is not None and len(detail["calls"]) >= len(steps)
            for k, step in enumerate(steps):
                # the viewer's step prompt is the request the step's answer came back to
                prompt = step_prompt(reader, row, steps, k)
                assert not prompt.rebuilt
                assert (prompt.sent.prompt, prompt.sent.messages, step.raw_output) in [
                    (s.prompt, s.messages, text) for s, text in by_site[(row.episode_id, k)]
                ]
                assert detail["steps"][k]["prompt_source"] == "recorded"
                # the page's copy: what each step keeps of the one before, and adds
                text = row.prompt_prefix
                for shown in detail["steps"][: k + 1]:
                    text = text[: shown["prompt_keep"]] + shown["prompt_add"]
                assert text == prompt.shown
                checked += 1
        assert checked
        records = sft_records(reader)
        won = {e.episode_id for e in reader.episodes() if e.won}
        assert {r.metadata.episode_id for r in records} == won and won
        for record in records:
            exported = reader.episode(record.metadata.episode_id)
            assert exported is not None and record.metadata.prompt == "recorded"
            steps = reader.steps(exported.episode_id)
            messages = list(record.messages)
            if record.metadata.step is None:  # one conversation: its turns join to each prompt
                for k in range(len(steps)):
                    sent = step_prompt(reader, exported, steps, k).sent
                    assert joined(messages[: 2 + 2 * k]) == sent.prompt
            else:  # a record per step: the request as sent, then the answer
                sent = step_prompt(reader, exported, steps, record.metadata.step).sent
                turns = messages[:-1]
                if sent.messages is not None:
                    assert turns == sent.chat
                else:
                    assert joined(turns) == sent.prompt
                assert messages[-1]["role"] == "assistant"
        # the paper's protocol and chat-formatted requests are no one conversation; ReAct's
        # text prompts are (a planner's step answers another prompt: a record per step)
        whole = [r.metadata.step is None for r in records]
        if protocol == CODE or chat is not None:
            assert not any(whole)
        elif arm in ("react", "reflexion"):
            assert all(whole)


def test_the_paper_original_preset_shows_every_prompt_as_sent_and_exports_it(
    generated_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config paper-original`` (scripted outputs, the golden wording files): at every step
    the viewer shows the prompt the backend got, and its won episodes export as SFT records."""
    from experiments.cli import main

    recorders: list[Recorder] = []
    real = runner.make_backends

    def recording(cfg: Any, truth: Any) -> tuple[Recorder, Recorder]:
        actor, _ = real(cfg, truth)
        recorders.append(Recorder(actor))
        return recorders[-1], recorders[-1]

    monkeypatch.setattr(runner, "make_backends", recording)
    wording = [
        x for key, path in code_files().items() for x in (f"--{key.replace('_', '-')}", path)
    ]
    code = main([
        "run", "--config", "paper-original", "--model", "scripted:learner", "--no-serve",
        "--data", str(generated_games), "--games", "2", "--trials", "2", "--workers", "1",
        "--step-timeout-s", "600",
        "--run-dir", str(tmp_path / "paper"), *wording,
    ])  # fmt: skip
    assert code == 0
    (run_dir,) = [p.parent for p in (tmp_path / "paper").glob("*/run.sqlite")]
    sent = {(q.site.episode, q.site.step, a.text): q.prompt for r in recorders for q, a in r.seen}
    checked = 0
    with open_reader(run_dir) as reader:
        assert reader.get_meta("manifest")["config"]["protocol"] == CODE
        for row in reader.episodes():
            steps = reader.steps(row.episode_id)
            for k, step in enumerate(steps):
                prompt = step_prompt(reader, row, steps, k)
                assert not prompt.rebuilt
                assert prompt.shown == sent[(row.episode_id, k, step.raw_output)]
                checked += 1
        won = [e for e in reader.episodes() if e.won]
    assert checked > len(won) > 0
    out = io.StringIO()
    replay(run_dir, won[0].game, won[0].trial, out, prompts=True)
    shown = out.getvalue()
    assert "[0] prompt, as sent:" in shown and "rebuilt" not in shown
    failed = io.StringIO()
    replay(run_dir, won[0].game, 0, failed)
    assert "reflect (trial 0)" in failed.getvalue()  # its reflection call, prompt and answer
    out = tmp_path / "sft.jsonl"
    assert main(["export", str(run_dir), "--format", "sft", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["metadata"]["episode_id"] for r in records} == {e.episode_id for e in won}
    assert all(r["metadata"]["prompt"] == "recorded" for r in records)
    print(f"paper-original: {checked} step prompts as sent, {len(records)} SFT records")
