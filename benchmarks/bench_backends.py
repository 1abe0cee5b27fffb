"""Backend benchmarks, measured side by side in one run (medians of repeats; print ratios).

1. HTTP throughput: N requests sent concurrently vs one at a time, through the OpenAI backend,
   against ``python -m llama_cpp.server`` running the embedded Gemma 3 270M. llama-cpp-python's
   server has no parallel slots (one model object behind a global lock: requests are served one
   after another), so this shows what it does. The same comparison against the fault server with
   a fixed 0.1 s service time (a server that does serve in parallel) is the control for the
   client side.
2. Prefix cache of the embedded backend on ReAct prompts built by the agent's own prompt code:
   a cold step (no shared prefix in any slot) vs a warm step (the next step of the same
   episode), and two interleaved episodes with one slot vs two slots.

Run: ``python benchmarks/bench_backends.py [--repeats 3] [--n 8]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402

from agents.llm import GenerationConfig, Request, make_backend  # noqa: E402
from agents.llm.llamacpp_backend import embedded_model_path  # noqa: E402

GREEDY = GenerationConfig(temperature=0.0, max_tokens=16, stop=("\n",), seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_server(model: Path, n_ctx: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(n_ctx),
            "--logits_all",
            "false",
            "--verbose",
            "false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("llama_cpp.server exited at start")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return proc, f"{url}/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not start in 180 s")


def short_prompts(n: int, nonce: int) -> list[str]:
    return [
        f"[{nonce}-{i}] You are in the middle of a room. Looking around you, you see a desk {i}, "
        f"a drawer {i + 1} and a shelf 1.\nYour task is to: put a pen in drawer {i + 1}.\n"
        f"> go to desk {i}\nOn the desk {i}, you see a pen 1.\n>"
        for i in range(n)
    ]


def bench_http(args: argparse.Namespace) -> None:
    from tests.support.fault_server import FaultPlan, FaultServer

    n = args.n
    print(f"\n== HTTP: {n} requests concurrently vs one at a time (median of {args.repeats})")
    targets: list[tuple[str, str, Any]] = []
    proc, url = start_llama_server(embedded_model_path("gemma3-270m"), 2048)
    targets.append(("llama_cpp.server (gemma3-270m)", url, None))
    fault = FaultServer(FaultPlan(latency_s=0.1)).start()
    targets.append(("control: fault server, 0.1 s per request", fault.url, fault))
    try:
        for label, base_url, _ in targets:
            opts = {"base_url": base_url, "timeout": 600, "extra_body": {"repeat_penalty": 1.0}}
            serial = make_backend("openai:m", concurrency=1, **opts)
            parallel = make_backend("openai:m", concurrency=n, **opts)
            nonce = iter(range(10**6))
            # warm up: model pages, connection pools
            parallel.generate([Request(config=GREEDY, prompt=p) for p in short_prompts(2, -1)])

            def one_at_a_time(b: Any = serial, nonce: Any = nonce) -> None:
                for p in short_prompts(n, next(nonce)):
                    b.generate([Request(config=GREEDY, prompt=p)])

            def all_at_once(b: Any = parallel, nonce: Any = nonce) -> None:
                b.generate(
                    [Request(config=GREEDY, prompt=p) for p in short_prompts(n, next(nonce))]
                )

            t_serial = median_time(one_at_a_time, args.repeats)
            t_parallel = median_time(all_at_once, args.repeats)
            print(
                f"{label}: one at a time {n / t_serial:.2f} req/s, concurrent {n / t_parallel:.2f}"
                f" req/s -> speed-up x{t_serial / t_parallel:.2f}"
            )
            serial.close()
            parallel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        fault.stop()


def react_episode(task_type: str, game_index: int) -> tuple[str, list[tuple[str, str]]]:
    """A real actor prefix and a game's first observation + steps, from the shipped examples."""
    import json

    from agents.prompting import actor_prefix, example_texts

    examples = json.loads((ROOT / "agents" / "prompts" / "examples" / "alfworld.json").read_text())
    prefix = actor_prefix(example_texts(task_type))
    pool = [e for kind in examples.values() for e in kind]
    game = pool[game_index % len(pool)]
    steps = [(s["action"], s["observation"]) for s in game["steps"]]
    return prefix, [(game["observation"], ""), *steps]


def prompt_at(prefix: str, episode: list[tuple[str, str]], step: int) -> str:
    from agents.prompting import actor_prompt

    observation = episode[0][0]
    return actor_prompt(prefix, observation, episode[1 : 1 + step])


def bench_prefix_cache(args: argparse.Namespace) -> None:
    print(f"\n== embedded (gemma3-270m) prefix cache on ReAct prompts (median of {args.repeats})")
    backend = make_backend("embedded", n_ctx=8192, slots=2)
    prefix, episode = react_episode("clean", 0)
    tokens = backend.tokenize(prompt_at(prefix, episode, 3))
    print(f"prompt: {len(tokens)} tokens at step 3")
    counter = iter(range(10**6))

    def cold() -> None:
        # a different first line: nothing but BOS is shared with any slot
        p = f"({next(counter)}) " + prompt_at(prefix, episode, 3)
        backend.generate([Request(config=GREEDY, prompt=p)])

    def warm() -> None:
        k = 4 + next(counter) % 3
        backend.generate([Request(config=GREEDY, prompt=prompt_at(prefix, episode, k))])

    backend.generate([Request(config=GREEDY, prompt=prompt_at(prefix, episode, 3))])
    t_cold = median_time(cold, args.repeats)
    backend.generate([Request(config=GREEDY, prompt=prompt_at(prefix, episode, 3))])
    t_warm = median_time(warm, args.repeats)
    print(f"cold step {t_cold:.2f} s, warm step {t_warm:.2f} s -> speed-up x{t_cold / t_warm:.1f}")
    backend.close()

    # two episodes of the same task type, interleaved step by step, as the rollout batches them
    _, other = react_episode("clean", 1)
    results = {}
    for slots in (1, 2):
        b = make_backend("embedded", n_ctx=8192, slots=slots)
        b.generate(
            [Request(config=GREEDY, prompt=prompt_at(prefix, e, 1)) for e in (episode, other)]
        )
        times = []
        for step in range(2, 2 + args.repeats):
            start = time.perf_counter()
            b.generate(
                [
                    Request(config=GREEDY, prompt=prompt_at(prefix, e, step))
                    for e in (episode, other)
                ]
            )
            times.append(time.perf_counter() - start)
        results[slots] = statistics.median(times)
        b.close()
    print(
        f"two interleaved episodes, per batch: one slot {results[1]:.2f} s, two slots "
        f"{results[2]:.2f} s -> speed-up x{results[1] / results[2]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=8, help="requests per HTTP batch")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-cache", action="store_true")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if not args.skip_http:
        bench_http(args)
    if not args.skip_cache:
        bench_prefix_cache(args)


if __name__ == "__main__":
    main()
