"""transformers backend: stop truncation always; batched left-padded generation on a tiny
random model built here, when torch and transformers are installed (``reflexsim[hf]``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.llm import GenerationConfig, Message, Request
from agents.llm.base import ActionConstraint
from agents.llm.common import check_grounding, truncate_at_stop
from tests.support.backend_process import BackendProcess, converted_checkpoint
from tests.support.grounded_episodes import assert_grounded, play


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        (" go to desk 1\nOn the desk", ("\n",), (" go to desk 1", True)),
        (" a>b\n", (">", "\n"), (" a", True)),
        ("no stop", ("\n",), ("no stop", False)),
        ("stop at end\n", ("\n",), ("stop at end", True)),
        ("\nfirst char", ("\n",), ("", True)),
        ("x", (), ("x", False)),
    ],
)
def test_truncate_at_stop(text: str, stops: tuple[str, ...], expected: tuple[str, bool]) -> None:
    assert truncate_at_stop(text, stops) == expected


CORPUS = [
    "You are in the middle of a room.\n> go to desk 1\nOn the desk 1, you see a pen 1.\n",
    "> take pen 1 from desk 1\nYou pick up the pen 1 from the desk 1.\n",
    "> go to shelf 2\nOn the shelf 2, you see a book 3 and a mug 2.\n",
    "Your task is to: put a pen in the drawer.\n> look\nNothing happens.\n",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random weights and a byte-level BPE trained on a few lines."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("tiny-llama")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,  # peaked logits: greedy choices far from ties
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> Iterator[Any]:
    from agents.llm import make_backend

    backend = make_backend(f"hf:{tiny_model}", device="cpu", dtype="float32", batch_size=4)
    yield backend
    backend.close()


PROMPTS = [
    "You are in the middle of a room.\n>",
    "> go to desk 1\nOn the desk 1, you see a pen 1.\n> take pen 1 from desk 1\n>",
    "Your task is to: put a pen in the drawer.\n>",
    "> go to shelf 2\n>",
    "> look\nNothing happens.\n> go to desk 1\nOn the desk 1, you see a pen 1.\n>",
]


def test_batched_left_padded_greedy_equals_one_at_a_time(hf: Any) -> None:
    cfg = GenerationConfig(temperature=0.0, max_tokens=10, stop=())
    batched = hf.generate([Request(config=cfg, prompt=p) for p in PROMPTS])
    single = [hf.generate([Request(config=cfg, prompt=p)])[0] for p in PROMPTS]
    assert [c.text for c in batched] == [c.text for c in single]
    assert [c.prompt_tokens for c in batched] == [
        len(hf.tokenizer(p, add_special_tokens=True)["input_ids"]) for p in PROMPTS
    ]
    assert all(0 < c.completion_tokens <= 10 for c in batched)


def test_stop_strings_cut_the_text_and_end_the_row(hf: Any) -> None:
    free = GenerationConfig(temperature=0.0, max_tokens=24, stop=())
    stopped = GenerationConfig(temperature=0.0, max_tokens=24, stop=(" ",))
    long = hf.generate([Request(config=free, prompt=p) for p in PROMPTS])
    short = hf.generate([Request(config=stopped, prompt=p) for p in PROMPTS])
    for a, b in zip(long, short, strict=True):
        assert " " not in b.text
        assert a.text.startswith(b.text)
        if " " in a.text:
            assert b.finish_reason == "stop"
            assert b.completion_tokens <= a.completion_tokens


def test_sampling_is_seeded_and_chat_uses_the_template(hf: Any) -> None:
    cfg = GenerationConfig(temperature=1.0, top_p=1.0, max_tokens=8, stop=(), seed=3)
    a = hf.generate([Request(config=cfg, prompt=PROMPTS[0])])[0]
    b = hf.generate([Request(config=cfg, prompt=PROMPTS[0])])[0]
    assert a.text == b.text
    msgs = (Message("user", "go to desk 1"),)
    c = hf.generate([Request(config=cfg, messages=msgs)])[0]
    assert c.sent["prompt"] == "<|user|>go to desk 1\n<|assistant|>"
    assert hf.describe()["device"] == "cpu"


# -- grounded decoding: a logits processor over the tokens' texts ---------------------------------
ACTIONS = ("go to desk 1", "go to desk 10", "take pen 1 from desk 1", 'say "hi"', "look")


def test_grounded_rows_only_write_allowed_text(hf: Any) -> None:
    # random weights: whatever the model prefers, the mask leaves it nothing but allowed text
    from agents.llm.grounding import is_complete, viable_prefix

    assert check_grounding(hf) == "transformers logits processor over token texts"
    thinking = ActionConstraint(ACTIONS)
    commands = ActionConstraint(ACTIONS, allow_think=False, lead="")
    configs = [
        GenerationConfig(temperature=0.0, max_tokens=24, stop=("\n",)),
        GenerationConfig(temperature=1.0, max_tokens=12, stop=("\n",), seed=5, n=2),
    ]
    for cfg in configs:
        for constraint in (thinking, commands):
            requests = [Request(config=cfg, prompt=p, constraint=constraint) for p in PROMPTS]
            requests.append(Request(config=cfg, prompt=PROMPTS[0]))  # a free row in the batch
            out = hf.generate(requests)
            for c in out[:-1]:
                for text in (c.text, *c.alternatives):
                    if c.finish_reason == "length":
                        assert viable_prefix(constraint, text, newline=False), text
                    else:
                        assert is_complete(constraint, text, newline=False), text
            if constraint is commands:
                assert all(c.text in ACTIONS for c in out[:-1] if c.finish_reason == "stop")


HF_PYTHON = os.environ.get("REFLEXSIM_VLLM_PYTHON")  # its venv holds torch and transformers


@pytest.mark.slow
@pytest.mark.skipif(not HF_PYTHON, reason="set REFLEXSIM_VLLM_PYTHON to a python with torch")
def test_grounded_episodes_hf_gemma(generated_games: Path, tmp_path: Path) -> None:
    assert HF_PYTHON
    model = converted_checkpoint(HF_PYTHON)
    options = {"dtype": "float32", "device": "cpu", "batch_size": "3"}
    server = BackendProcess(HF_PYTHON, f"hf:{model}", options, tmp_path / "hf.log")
    try:
        assert server.ready["grounding"] == "transformers logits processor over token texts"
        # one batched step of three games: transformers on two shared cores is slow
        steps = play(lambda r: server.send("generate", r)[0], generated_games, steps=1)
    finally:
        server.close()
    assert_grounded(steps, each=1)
