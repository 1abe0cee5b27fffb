"""Drive the real vLLM backend with ReAct-shaped prompts and print what happened as JSON.

Run with a python that has vllm (the .venv-vllm from scripts/setup_vllm_cpu.sh):

    .venv-vllm/bin/python scripts/vllm_smoke.py --model ~/.cache/reflexsim/gemma3-270m-hf

Mode ``ticks`` (the default) plays what the runner does with several episodes in flight: tick 1
sends the first step of 4 episodes as one batch; tick 2 sends each episode's next step (its
prompt grown by the action and an observation) plus one chat-message reflection request, again
as one batch; a replay resends tick 1 unchanged, twice (greedy decoding must give the same texts,
and the prefix cache must now hold those prompts); then tick 1 again under grounded decoding
(only one of three commands allowed). The last stdout line is one JSON object. This checks the
batch engine (``vllm.LLM``) by hand, e.g. on a new GPU box; the test suite drives the async
engine, which runs use, through ``scripts/backend_stdio.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from agents.llm.base import (  # noqa: E402
    ActionConstraint,
    Completion,
    GenerationConfig,
    Message,
    Request,
)
from agents.llm.vllm_backend import VLLMBackend  # noqa: E402

ACT = GenerationConfig(temperature=0.0, max_tokens=24, stop=("\n",), seed=0)
REFLECT = GenerationConfig(temperature=0.0, max_tokens=48, stop=(), seed=0)
GROUNDED = ActionConstraint(("go to desk 1", "go to shelf 1", "look"), allow_think=False)

PREFIX = """Interact with a household to solve a task. Write one action per line after "> ".
Here are two examples.

You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a drawer 1, and a sinkbasin 1.

Your task is to: put a clean cloth in cabinet.
> think: To solve the task, I need to find a cloth, clean it with the sinkbasin, then put it in the cabinet.
OK.
> go to countertop 1
You arrive at countertop 1. On the countertop 1, you see a cloth 1, and a soapbar 2.
> take cloth 1 from countertop 1
You pick up the cloth 1 from the countertop 1.
> go to sinkbasin 1
You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing.
> clean cloth 1 with sinkbasin 1
You clean the cloth 1 using the sinkbasin 1.
> go to cabinet 1
You arrive at cabinet 1. The cabinet 1 is open. In it, you see nothing.
> move cloth 1 to cabinet 1
You move the cloth 1 to the cabinet 1.

You are in the middle of a room. Looking quickly around you, you see a countertop 1, a fridge 1, a microwave 1, and a shelf 1.

Your task is to: put a clean apple in fridge.
> think: First I need to find an apple. It is probably on the countertop.
OK.
> go to countertop 1
You arrive at countertop 1. On the countertop 1, you see a apple 1, and a knife 1.
> take apple 1 from countertop 1
You pick up the apple 1 from the countertop 1.
> go to fridge 1
You arrive at fridge 1. The fridge 1 is closed.
> open fridge 1
You open the fridge 1. The fridge 1 is open. In it, you see a egg 1.
> move apple 1 to fridge 1
You move the apple 1 to the fridge 1.

Here is the task.
"""

GAMES = [
    ("a bed 1, a desk 1, a drawer 1, and a shelf 1", "put a book on desk", "book 1", "bed 1"),
    (
        "a cabinet 1, a countertop 1, a sinkbasin 1, and a toilet 1",
        "put a clean soapbar in cabinet",
        "soapbar 1",
        "toilet 1",
    ),
    (
        "a countertop 1, a fridge 1, a microwave 1, and a stoveburner 1",
        "put a hot mug in cabinet",
        "mug 2",
        "countertop 1",
    ),
    (
        "a armchair 1, a coffeetable 1, a desk 1, and a floorlamp 1",
        "examine the pen with the floorlamp",
        "pen 1",
        "coffeetable 1",
    ),
]


def first_prompt(game: tuple[str, str, str, str]) -> str:
    room, task, _, _ = game
    return (
        f"{PREFIX}You are in the middle of a room. Looking quickly around you, you see {room}.\n\n"
        f"Your task is to: {task}.\n>"
    )


def next_prompt(prompt: str, action: str, game: tuple[str, str, str, str]) -> str:
    _, _, item, place = game
    action = action.strip() or "look"
    if action.startswith("think:"):
        observation = "OK."
    else:
        observation = f"You arrive at {place}. On the {place}, you see a {item}."
    return f"{prompt} {action}\n{observation}\n>"


def reflection_request(game: tuple[str, str, str, str]) -> Request:
    _, task, item, place = game
    transcript = (
        f"Task: {task}.\n> go to desk 1\nNothing happens.\n> go to desk 1\nNothing happens."
    )
    return Request(
        config=REFLECT,
        messages=(
            Message(
                "user",
                f"{transcript}\nStatus: failed.\nIn one sentence, write a better plan. "
                f"Hint: the {item} is at the {place}.",
            ),
        ),
        purpose="reflect",
    )


def summary(completion: Completion) -> dict[str, Any]:
    return {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "cached_tokens": completion.cached_tokens,
        "latency_s": round(completion.latency_s, 4),
        "sent": completion.sent if isinstance(completion.sent, str) else None,
    }


def timed(backend: VLLMBackend, requests: list[Request]) -> tuple[list[Completion], float]:
    started = time.perf_counter()
    completions = backend.generate(requests)
    return completions, time.perf_counter() - started


def run_ticks(backend: VLLMBackend) -> dict[str, Any]:
    prompts = [first_prompt(game) for game in GAMES]
    tick1, t1 = timed(backend, [Request(config=ACT, prompt=p) for p in prompts])
    grown = [next_prompt(p, c.text, g) for p, c, g in zip(prompts, tick1, GAMES, strict=True)]
    tick2_requests = [Request(config=ACT, prompt=p) for p in grown]
    tick2_requests.append(reflection_request(GAMES[0]))
    tick2, t2 = timed(backend, tick2_requests)
    replay, t3 = timed(backend, [Request(config=ACT, prompt=p) for p in prompts])
    again, t4 = timed(backend, [Request(config=ACT, prompt=p) for p in prompts])
    # grounded decoding on the batch engine: structured outputs in SamplingParams
    grounded, t5 = timed(
        backend, [Request(config=ACT, prompt=p, constraint=GROUNDED) for p in prompts]
    )
    return {
        "ticks": [
            {"name": "tick1", "wall_s": round(t1, 3), "completions": [summary(c) for c in tick1]},
            {
                "name": "tick2",
                "wall_s": round(t2, 3),
                "completions": [summary(c) for c in tick2],
                "chat_sent": tick2[-1].sent,
            },
            {"name": "replay", "wall_s": round(t3, 3), "completions": [summary(c) for c in replay]},
            {"name": "again", "wall_s": round(t4, 3), "completions": [summary(c) for c in again]},
        ],
        "grounded": {"wall_s": round(t5, 3), "completions": [summary(c) for c in grounded]},
    }


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        # On the CPU build gpu_memory_utilization means a share of host RAM; ask for a fixed,
        # small KV cache instead (the machine is shared).
        "kv_cache_memory_bytes": args.kv_cache_mib * 1024 * 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="HF checkpoint folder")
    parser.add_argument("--mode", choices=["ticks"], default="ticks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    # float32, not the checkpoint's bfloat16: in bfloat16 on CPU a prompt computed partly from the
    # prefix cache can flip a greedy near-tie against the same prompt computed cold.
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    collect = _Collect()
    log = logging.getLogger("agents.llm.vllm")
    log.setLevel(logging.INFO)
    log.addHandler(collect)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    backend = VLLMBackend(str(args.model), **engine_options(args))
    started = time.perf_counter()
    backend.load()
    load_s = time.perf_counter() - started
    try:
        result = run_ticks(backend)
    finally:
        backend.close()
    result.update(
        {
            "mode": args.mode,
            "load_s": round(load_s, 2),
            "describe": backend.describe(),
            "log": [line for line in collect.lines if line.startswith("vllm generate")],
        }
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
