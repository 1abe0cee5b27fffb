"""Incremental prompt tokenization: spliced ids equal the whole prompt's, with Gemma 3's own
tokenizer on ReAct prompts (in the python that has tokenizers), and the fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from agents.llm.prefix_tokens import PrefixTokenizer
from tests.support.backend_process import REPO, converted_checkpoint, offline_env

sys.path.insert(0, str(REPO / "scripts"))  # the converter is a script, not a package
from convert_embedded_to_hf import default_out  # noqa: E402

# A greedy longest-match tokenizer whose vocabulary has tokens across the junctions a step
# makes ("\n>", "> go", "OK.\n"), so splicing has merges to get right.
VOCAB = sorted(
    {"\n>", "> go", " go", "OK.\n", "OK.", "go", "to", " to", " ", "\n", ">", "."}
    | set("abcdefghijklmnopqrstuvwxyz0123456789:,.KO "),
    key=len,
    reverse=True,
)


def toy_piece(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        token = next(t for t in VOCAB if text.startswith(t, i))
        ids.append(VOCAB.index(token))
        i += len(token)
    return ids


def toy_whole(text: str) -> list[int]:
    return [-1, *toy_piece(text)]  # -1: the BOS token


def toy_decode(ids: Sequence[int]) -> str:
    return "".join("" if i < 0 else VOCAB[i] for i in ids)


def test_growing_prompts_splice_to_the_whole_tokenization() -> None:
    tok = PrefixTokenizer(toy_whole, toy_piece, toy_decode, overlap=3, check=True)
    prompt = "you are in a room.\nyour task is to: find a key.\n>"
    for step in range(6):
        assert tok.ids("e1", prompt) == toy_whole(prompt)
        prompt += f" go to drawer {step}\nOK.\n>"
    # the first step's junction ".\n>" + " go" splices; after "OK.\n>" the ">" merges into
    # "> go", which the overlap check sees: those prompts are tokenized whole
    assert (tok.spliced, tok.whole, tok.mismatched) == (1, 5, 0)


def test_what_does_not_extend_the_kept_prompt_is_tokenized_whole() -> None:
    tok = PrefixTokenizer(toy_whole, toy_piece, toy_decode, overlap=3, check=True)
    tok.ids("e1", "a room.\n> go to desk 1\nOK.\n>")
    assert tok.ids("e1", "a room.\n> go to desk 2\n>") == toy_whole("a room.\n> go to desk 2\n>")
    assert tok.ids("e2", "a room.\n>") == toy_whole("a room.\n>")  # another episode: its own
    assert (tok.spliced, tok.whole) == (0, 3)
    # the junction moved: "OK." + ".\n" re-tokenizes the kept "OK." as "OK" "." "\n"... whole
    tok.ids("e3", "say OK.")
    assert tok.ids("e3", "say OK.\n>") == toy_whole("say OK.\n>")
    tok.forget("e3")
    assert tok.ids("e3", "say OK.\n> go") == toy_whole("say OK.\n> go")
    assert tok.mismatched == 0


def test_only_keep_episodes_are_remembered() -> None:
    tok = PrefixTokenizer(toy_whole, toy_piece, toy_decode, overlap=2, keep=2)
    for key in ("a", "b", "c"):
        tok.ids(key, f"{key} room.\n>")
    tok.ids("a", "a room.\n> go to desk 1")  # "a" was dropped: whole again
    assert (tok.spliced, tok.whole) == (0, 4)


HF_PYTHON = os.environ.get("REFLEXSIM_VLLM_PYTHON")  # its venv holds tokenizers

GEMMA_CHECK = """
import json, sys
from tokenizers import Tokenizer
from agents.llm.prefix_tokens import PrefixTokenizer
from agents.prompting import actor_prefix, example_texts
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
def encode(text, special=True):
    return tok.encode(text, add_special_tokens=special).ids
inc = PrefixTokenizer(
    encode, lambda t: encode(t, False), lambda ids: tok.decode(list(ids)), check=True
)
prompt = actor_prefix(example_texts("clean")) + (
    "Here is the task.\\nYou are in the middle of a room. Looking quickly around you, you see a "
    "cabinet 1, a countertop 1, a sinkbasin 1, and a fridge 1.\\nYour task is to: put a clean "
    "apple in fridge.\\n>"
)
steps = [
    (" think: To solve the task, I need to find an apple. ", "OK."),
    (" go to countertop 1", "On the countertop 1, you see a apple 1, and a knife 2."),
    (" take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1."),
    (" go to sinkbasin 1", "On the sinkbasin 1, you see nothing."),
    (" clean apple 1 with sinkbasin 1", "You clean the apple 1 using the sinkbasin 1."),
    (" ", "Nothing happens."),
    (" go to fridge 1", "The fridge 1 is closed. Ünïcödé ✓ 冰箱"),
]
for action, observation in steps:
    inc.ids("e", prompt)
    prompt += action + "\\n" + observation + "\\n>"
ids = inc.ids("e", prompt)
assert ids == encode(prompt)
print(json.dumps({"spliced": inc.spliced, "whole": inc.whole, "mismatched": inc.mismatched,
                  "vocab": tok.get_vocab_size()}))
"""


@pytest.mark.slow  # with the vLLM venv's tokenizers, which CI makes for the slow set
@pytest.mark.skipif(not HF_PYTHON, reason="set REFLEXSIM_VLLM_PYTHON to a python with tokenizers")
def test_gemma_tokenizer_spliced_ids_equal_whole_on_react_prompts() -> None:
    assert HF_PYTHON is not None
    checkpoint = default_out()  # only its tokenizer files are read
    if not (checkpoint / "tokenizer.json").is_file():
        checkpoint = Path(converted_checkpoint(HF_PYTHON))
    out = subprocess.run(
        [HF_PYTHON, "-c", GEMMA_CHECK, str(checkpoint)],
        cwd=REPO, env={**offline_env(), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vocab"] == 262144
    assert result["mismatched"] == 0, result
    assert result["spliced"] >= 6 and result["whole"] >= 1, result
