"""llama.cpp: the embedded models in process, slot routing, and the OpenAI backend against a real
``llama_cpp.server`` giving the same greedy outputs as the in-process backend."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.llm import GenerationConfig, Message, Request, make_backend
from agents.llm.base import ActionConstraint
from agents.llm.common import check_grounding
from agents.llm.grounding import gbnf_for
from agents.llm.llamacpp_backend import common_prefix, route
from tests.support.grounded_episodes import NASTY, assert_grounded, play

llama_cpp = pytest.importorskip("llama_cpp")

EXAMPLE = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, "
    "a countertop 1, a drawer 1, a fridge 1, and a sinkbasin 1.\n"
    "Your task is to: put a clean mug in coffeemachine.\n"
    "> go to countertop 1\nOn the countertop 1, you see a mug 1.\n"
    "> take mug 1 from countertop 1\nYou pick up the mug 1 from the countertop 1.\n"
    "> go to sinkbasin 1\nOn the sinkbasin 1, you see nothing.\n"
    "> clean mug 1 with sinkbasin 1\nYou clean the mug 1 using the sinkbasin 1.\n"
)
HEADER = "Interact with a household to solve a task. Here is an example.\n" + EXAMPLE + "\n"


def episode_prompt(task: str, steps: int) -> str:
    """A ReAct-shaped prompt: instruction, example, task, transcript, ending in '>'."""
    text = HEADER + f"Here is the task.\nYou are in a room.\nYour task is to: {task}.\n"
    for i in range(steps):
        text += f"> go to drawer {i + 1}\nOn the drawer {i + 1}, you see a key {i + 1}.\n"
    return text + ">"


GREEDY = GenerationConfig(temperature=0.0, max_tokens=12, stop=("\n",), seed=0)


@pytest.fixture(scope="module")
def embedded() -> Iterator[Any]:
    backend = make_backend("embedded", n_ctx=4096, slots=3)
    yield backend
    backend.close()


# -- routing (pure) ------------------------------------------------------------------------------
def test_route_keeps_each_episode_on_its_own_slot() -> None:
    shared = [1, 2, 3, 4]
    a, b = [*shared, 10, 11], [*shared, 20, 21]
    # both slots warm: each continuation goes to the slot holding its history
    assert route([[*b, 22], [*a, 12]], [a, b], [1, 2], capacity=2) == [1, 0]
    # a new episode takes a new slot while there is room, not a warm one
    assert route([[*a, 12], [*shared, 30]], [a], [1], capacity=3) == [0, 1]
    # no room: it takes the unclaimed slot sharing most with it (the few-shot prefix)
    assert route([[*a, 12], [*shared, 30]], [a, b], [1, 2], capacity=2) == [0, 1]
    # more prompts than slots: slots are shared, best prefix first
    assert route([[*a, 1], [*a, 2], [*b, 3]], [a, b], [1, 2], capacity=2) == [0, 0, 1]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    # an empty slot (the one made at load) is used before a new one is made
    assert route([[1, 2], [3, 4]], [[]], [0], capacity=3) == [0, 1]


def test_route_never_takes_another_episodes_slot_while_there_is_room() -> None:
    # Requests served one at a time come in batches of one: a prompt that shares only the
    # instruction (or the BOS token) with a warm slot takes a fresh slot, so the episode that
    # slot holds is not evaluated cold on its next step.
    instruction = [1, 2]
    a, b = [*instruction, 10, 11, 12, 13], [*instruction, 20, 21]
    assert route([b], [a[:4]], [1], capacity=4, block=2) == [1]
    assert route([[*a, 14]], [a[:4], b[:4]], [1, 2], capacity=4, block=2) == [0]
    # no room: the slot it can reuse the most whole blocks of, else the least recently used
    c = [*a[:4], 30, 31]
    assert route([c], [b[:4], a[:6]], [1, 2], capacity=2, block=2) == [1]
    assert route([[*instruction, 40, 41]], [a[:4], b[:4]], [2, 1], capacity=2, block=4) == [1]


# -- the embedded model in process ---------------------------------------------------------------
@pytest.mark.slow
def test_embedded_greedy_is_deterministic_and_stops_at_newline(embedded: Any) -> None:
    prompt = episode_prompt("put a clean mug in coffeemachine", 0)
    first = embedded.generate([Request(config=GREEDY, prompt=prompt)])[0]
    again = embedded.generate([Request(config=GREEDY, prompt=prompt)])[0]
    assert first.text == again.text and first.text.strip()
    assert "\n" not in first.text
    assert first.finish_reason in ("stop", "length")
    llm = embedded._slots[0].llm
    assert first.prompt_tokens == len(llm.tokenize(prompt.encode(), add_bos=True, special=True))
    assert 0 < first.completion_tokens <= GREEDY.max_tokens
    # the whole n_batch blocks of the prompt, short of its last token
    assert again.cached_tokens == (again.prompt_tokens - 1) // embedded.n_batch * embedded.n_batch
    assert first.sent["prompt"] == prompt


@pytest.mark.slow
def test_interleaved_episodes_stay_warm_on_their_slots(embedded: Any) -> None:
    tasks = ["find a key", "heat an apple"]
    for step in range(4):
        out = embedded.generate(
            [Request(config=GREEDY, prompt=episode_prompt(t, step)) for t in tasks]
        )
    assert embedded.slots_in_use == 2
    # each episode finds all the whole blocks of its prompt in its slot's KV cache
    block = embedded.n_batch
    assert all(c.cached_tokens == (c.prompt_tokens - 1) // block * block > 0 for c in out)


@pytest.mark.slow
def test_cached_tokens_match_llama_cpp_own_count(embedded: Any) -> None:
    llm_before = {id(s.llm) for s in embedded._slots}
    prompt = episode_prompt("cool a tomato", 4)
    embedded.generate([Request(config=GREEDY, prompt=prompt)])
    slot = max(embedded._slots, key=lambda s: s.last_used)
    assert id(slot.llm) in llm_before
    llama_cpp.llama_perf_context_reset(slot.llm.ctx)
    longer = prompt + " go to drawer 9\nOn the drawer 9, you see nothing.\n>"
    c = embedded.generate([Request(config=GREEDY, prompt=longer)])[0]
    evaluated = llama_cpp.llama_perf_context(slot.llm.ctx).n_p_eval
    assert c.prompt_tokens - c.cached_tokens == evaluated


@pytest.mark.slow
def test_seed_is_honoured_when_sampling() -> None:
    # Two fresh backends: a sampled text is reproducible for the same seed, and seeds matter.
    prompt = "You are in a room. Your task is to: look at a book under the desklamp.\n>"

    def sample(backend: Any, seed: int) -> str:
        cfg = GenerationConfig(temperature=1.0, top_p=1.0, max_tokens=8, stop=("\n",), seed=seed)
        return str(backend.generate([Request(config=cfg, prompt=prompt)])[0].text)

    first, second = (make_backend("embedded", n_ctx=1024, slots=1) for _ in range(2))
    assert sample(first, 1) == sample(second, 1)
    assert len({sample(first, s) for s in (2, 3, 4, 5)}) > 1
    first.close()
    second.close()


@pytest.mark.slow
def test_a_sample_does_not_depend_on_what_its_slot_served_before() -> None:
    # One slot, so each request finds the cache in another state: cold, holding another task's
    # episode, holding the same episode two steps back, holding this very prompt. llama.cpp's
    # logits for a prompt continued from an arbitrary cached prefix differ from a cold
    # evaluation's; reusing whole n_batch blocks only keeps every sample the same.
    # A free-text thought, n=2 (the second sample follows the first's generated tokens): with
    # the whole cached prefix reused, the last state's samples came out different.
    cfg = GenerationConfig(temperature=0.8, top_p=1.0, max_tokens=24, stop=("\n",), seed=3, n=2)
    prompt = episode_prompt("find a key", 6) + " think: I"
    backend = make_backend("embedded", n_ctx=2048, slots=1, n_batch=64)
    try:
        texts, cached = [], []
        for before in (None, episode_prompt("heat an apple", 5), episode_prompt("find a key", 4)):
            if before is not None:
                backend.generate([Request(config=GREEDY, prompt=before)])
            for _ in range(2):  # the second finds this prompt itself in the cache
                c = backend.generate([Request(config=cfg, prompt=prompt)])[0]
                texts.append((c.text, *c.alternatives))
                cached.append(c.cached_tokens)
    finally:
        backend.close()
    assert len(set(texts)) == 1, texts
    assert cached[0] == 0 and len(set(cached[1:])) > 1, cached  # the cache states did differ


@pytest.mark.slow
def test_slots_run_at_once_and_give_what_one_at_a_time_gives() -> None:
    # A batch of two episodes' steps on two slots at once (each slot in its own thread) gives
    # the completions the same backend gives serving them one at a time, sampled or greedy.
    cfg = GenerationConfig(temperature=0.8, top_p=1.0, max_tokens=16, stop=("\n",), seed=5)
    prompts = [episode_prompt(t, 3) for t in ("find a key", "heat an apple")]
    batch = [Request(config=c, prompt=p) for p in prompts for c in (GREEDY, cfg)]
    answers = []
    for parallel in (2, 1):
        backend = make_backend(
            "embedded", n_ctx=2048, slots=4, parallel=parallel, n_threads=1, n_threads_batch=1
        )
        try:
            answers.append([(c.text, c.cached_tokens) for c in backend.generate(batch)])
            assert backend.slots_in_use == 4 and backend.describe()["parallel"] == parallel
            if parallel > 1:  # as the engine sends them: each request alone, from its thread
                assert backend.scheduling == "per_request"
                with ThreadPoolExecutor(len(batch)) as pool:
                    alone = [
                        f.result()[0] for f in [pool.submit(backend.generate, [r]) for r in batch]
                    ]
                assert [c.text for c in alone] == [t for t, _ in answers[0]]
        finally:
            backend.close()
    assert answers[0] == answers[1], answers


@pytest.mark.slow
def test_smollm2_renders_chat_messages_with_its_template() -> None:
    backend = make_backend("embedded:smollm2-135m", n_ctx=1024)
    msgs = (Message("user", "Name a fruit."),)
    c = backend.generate([Request(config=GenerationConfig(max_tokens=8), messages=msgs)])[0]
    assert "<|im_start|>user\nName a fruit.<|im_end|>" in c.sent["prompt"]
    assert c.sent["prompt"].endswith("<|im_start|>assistant\n")
    assert c.completion_tokens > 0
    assert backend.describe()["chat_template"] == "gguf"
    backend.close()


def test_llamacpp_spec_errors_are_one_line(tmp_path: Path) -> None:
    from agents.llm import SpecError

    with pytest.raises(SpecError, match="no GGUF file at"):
        make_backend(f"llamacpp:{tmp_path / 'missing.gguf'}")
    with pytest.raises(SpecError, match=r"unknown option\(s\) n_ctxx"):
        make_backend("embedded", n_ctxx=10)


# -- a real llama_cpp.server ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def llama_server(embedded: Any) -> Iterator[str]:
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python[server]")
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(embedded.model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(embedded.n_ctx),
        "--logits_all",
        "false",  # its default (true) keeps n_ctx x 262k floats of logits for Gemma
        "--verbose",
        "false",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                pytest.fail(f"llama_cpp.server exited: {err[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("llama_cpp.server did not become healthy in 180 s")
            time.sleep(0.5)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_backend(url: str, **options: Any) -> Any:
    """The OpenAI backend on the llama.cpp server. The server samples with repeat_penalty=1.1
    unless told; the OpenAI API (and the in-process backend) apply none, so it is sent."""
    return make_backend(
        "openai:gemma3-270m",
        base_url=url,
        extra_body={"repeat_penalty": 1.0},
        timeout=300,
        **options,
    )


@pytest.mark.slow
def test_openai_backend_on_llama_cpp_server_matches_in_process_greedy(
    embedded: Any, llama_server: str
) -> None:
    remote = server_backend(llama_server, concurrency=4)
    prompts = [
        episode_prompt("put a clean mug in coffeemachine", 0),
        episode_prompt("find a key", 2),
        episode_prompt("heat an apple", 1),
    ]
    reqs = [Request(config=GREEDY, prompt=p) for p in prompts]
    over_http = remote.generate(reqs)
    local = embedded.generate(reqs)
    remote.close()
    assert [c.text for c in over_http] == [c.text for c in local]
    for h, lc in zip(over_http, local, strict=True):
        assert h.prompt_tokens == lc.prompt_tokens > 0  # the server's usage, the same tokenizer
        assert h.completion_tokens > 0
        assert h.sent["endpoint"] == "completions"
        assert h.sent["extra_body"] == {"repeat_penalty": 1.0}


# -- grounded decoding: llama.cpp grammars, in process and through the server ---------------------
@pytest.mark.slow
def test_grounded_episodes_embedded_in_process(embedded: Any, generated_games: Path) -> None:
    assert check_grounding(embedded) == "llama.cpp GBNF grammar"
    assert_grounded(play(embedded.generate, generated_games))


@pytest.mark.slow
def test_grounded_episodes_smollm2_in_process(generated_games: Path) -> None:
    backend = make_backend("embedded:smollm2-135m", n_ctx=4096, slots=3)
    try:
        assert_grounded(play(backend.generate, generated_games))
    finally:
        backend.close()


@pytest.mark.slow
def test_grounded_episodes_through_llama_cpp_server(
    llama_server: str, generated_games: Path
) -> None:
    remote = server_backend(llama_server, grammar_dialect="llamacpp")
    try:
        steps = play(remote.generate, generated_games)
    finally:
        remote.close()
    assert_grounded(steps)


@pytest.mark.slow
def test_grammar_escapes_quotes_and_backslashes(embedded: Any) -> None:
    prompt = episode_prompt("say something", 0)
    for first in range(len(NASTY)):
        actions = NASTY[first:] + NASTY[:first]
        c = ActionConstraint(actions, allow_think=False)
        (out,) = embedded.generate([Request(config=GREEDY, prompt=prompt, constraint=c)])
        assert out.text[1:] in actions, out.text
    # every grammar built from arbitrary single-line commands parses in llama.cpp itself
    vocab = embedded._slots[0].llm._model.vocab
    commands = st.lists(
        st.text(st.characters(blacklist_characters="\n\x00"), min_size=1, max_size=20),
        min_size=1,
        max_size=5,
    )

    @settings(max_examples=60, deadline=None)
    @given(actions=commands, allow=st.booleans())
    def parses(actions: list[str], allow: bool) -> None:
        text = gbnf_for(ActionConstraint(tuple(actions), allow_think=allow))
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), b"root")
        assert sampler, text
        llama_cpp.llama_sampler_free(sampler)

    parses()
