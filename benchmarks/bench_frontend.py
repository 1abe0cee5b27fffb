"""Frontend benchmark: the runner's own CPU time per step with 128 episodes in flight.

The model is instant and in process (``scripted:expert``: the walkthrough's next move, as text,
through the real engine, its async loop and its batching); the envs are real ALFWorld games in
real worker processes (valid_seen, ``--workers 2``). What a GPU engine would leave to the
frontend is what is measured, per env step, as thread CPU time in the runner's process:

- store: every ``RunStore`` write (SQLite);
- prompt building: ``agents.react.actor_request`` (the whole ReAct prompt of the step);
- scripted text: the stand-in for the model (not frontend work; shown apart);
- engine: the rest of the process's CPU time over the trial (event loop, env client, parsing,
  episode bookkeeping);
- tokenization: the prompts the run built, tokenized afterwards with Gemma 3's tokenizer (262k
  vocabulary: the converted embedded checkpoint's, ``scripts/convert_embedded_to_hf.py``) as a
  vLLM frontend does it, whole every step, and incrementally (each episode's previous ids
  kept, the appended text tokenized, :class:`agents.llm.prefix_tokens.PrefixTokenizer`), each
  spliced result checked against the whole tokenization. It runs in the first Python that has
  ``transformers``: this one, else ``$REFLEXSIM_VLLM_PYTHON`` / ``.venv-vllm``.

Medians of ``--repeats`` runs (each run's prompts tokenized once), side by side:

    python benchmarks/bench_frontend.py [--data DIR] [--games 140] [--concurrency 128] [--repeats 3]

Measured (128 games, 128 in flight, 841 steps, prompts of 1607 tokens median, 2 shared cores
under load; medians of 3, ms of CPU per step): engine 0.837, store 0.302, prompt building
0.054, whole-prompt tokenization 1.545 (56% of the frontend's 2.738 ms); incremental
tokenization 0.285 (5.4x less; frontend 1.479 ms, 1.85x less), 713 of 841 prompts spliced,
none different from the whole tokenization. Hence the vLLM backend sends episodes' prompts as
ids (:class:`agents.llm.prefix_tokens.EpisodePromptIds`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import data_parser  # noqa: E402

SPLIT = "eval_in_distribution"  # valid_seen
PARTS = ("engine", "store", "prompt building", "scripted text")


class CpuMeter:
    """Thread CPU time per part; a call inside a measured call of the same part counts once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = threading.local()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, part, 0)
            setattr(self._depth, part, depth + 1)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self._depth, part, depth)
                if depth == 0:
                    self.seconds[part] += time.thread_time() - start

        return measured


@contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def one_run(data: Path, games: int, concurrency: int, workers: int) -> dict[str, Any]:
    """Play the games once; CPU seconds per part, env steps, and every actor prompt by episode."""
    from contextlib import ExitStack

    import agents.react as react
    from agents.llm.scripted import ScriptedBackend
    from experiments.config import RunConfig
    from experiments.engine import Engine
    from experiments.runner import run
    from experiments.store import RunStore

    meter = CpuMeter()
    prompts: list[tuple[str, str]] = []
    window: dict[str, float] = {}
    build = react.actor_request

    def actor_request(*args: Any, **kwargs: Any) -> Any:
        request = build(*args, **kwargs)
        prompts.append((str(kwargs.get("episode")), request.prompt))
        return request

    play = Engine.play

    async def timed_play(*args: Any, **kwargs: Any) -> Any:
        # the window: from the first episode's start to the last one's end
        window.setdefault("start", time.process_time())
        try:
            return await play(*args, **kwargs)
        finally:
            window["end"] = time.process_time()

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        for name, fn in list(vars(RunStore).items()):
            if callable(fn) and not name.startswith("_"):
                stack.enter_context(patched(RunStore, name, meter.wrap("store", fn)))
        stack.enter_context(patched(Engine, "play", timed_play))
        stack.enter_context(patched(react, "actor_request", meter.wrap("prompt building", actor_request)))  # fmt: skip
        stack.enter_context(
            patched(
                ScriptedBackend, "generate", meter.wrap("scripted text", ScriptedBackend.generate)
            )
        )
        cfg = RunConfig.of(
            model="scripted:expert", data=str(data), split=SPLIT, games=games, trials=1,
            concurrency=concurrency, workers=workers, run_dir=str(Path(tmp) / "run"),
        )  # fmt: skip
        reader = RunStore(run(cfg), readonly=True)
        steps = reader.conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        won = sum(e.won for e in reader.episodes())
        reader.close()
    total = window["end"] - window["start"]
    parts = dict(meter.seconds)
    parts["engine"] = total - sum(parts.get(p, 0.0) for p in PARTS[1:])
    return {"parts": parts, "steps": steps, "won": won, "prompts": prompts}


# -- tokenization (runs in a Python that has transformers) ---------------------------------------
def tokenizer_dir() -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from convert_embedded_to_hf import default_out

    return Path(default_out())


def tokenize_prompts(prompts_file: Path, repeats: int) -> dict[str, Any]:
    """Per repeat: CPU seconds to tokenize every prompt whole, and incrementally."""
    from transformers import AutoTokenizer

    from agents.llm.prefix_tokens import PrefixTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    prompts = json.loads(prompts_file.read_text())

    def encode(text: str) -> list[int]:
        return list(tok.encode(text))

    def encode_piece(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def decode(ids: Any) -> str:
        return str(tok.decode(list(ids)))

    whole, incremental, counts = [], [], {}
    for _ in range(repeats):
        start = time.thread_time()
        for _, text in prompts:
            encode(text)
        whole.append(time.thread_time() - start)
        inc = PrefixTokenizer(encode, encode_piece, decode)
        start = time.thread_time()
        for key, text in prompts:
            inc.ids(key, text)
        incremental.append(time.thread_time() - start)
    checked = PrefixTokenizer(encode, encode_piece, decode, check=True)
    for key, text in prompts:
        checked.ids(key, text)
    counts = {"spliced": checked.spliced, "whole": checked.whole, "mismatched": checked.mismatched}
    lengths = sorted(len(encode(t)) for _, t in prompts[:: max(1, len(prompts) // 200)])
    return {
        "whole": whole, "incremental": incremental, "counts": counts,
        "vocab": len(tok), "median_prompt_tokens": statistics.median(lengths),
    }  # fmt: skip


def tokenize_elsewhere(prompts: list[tuple[str, str]]) -> dict[str, Any]:
    """:func:`tokenize_prompts` once, in the python that has ``transformers``."""
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "prompts.json"
        file.write_text(json.dumps(prompts))
        out = subprocess.run(
            [tokenizing_python(), __file__, "--tokenize", str(file), "--repeats", "1"],
            check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def tokenizing_python() -> str:
    if importlib.util.find_spec("transformers") is not None:
        return sys.executable
    found = os.environ.get("REFLEXSIM_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(found).exists():
        found = str(ROOT.parent / "main" / ".venv-vllm" / "bin" / "python")
    return found


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--games", type=int, default=140)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenize", type=Path, help=argparse.SUPPRESS)  # the inner step
    args = parser.parse_args()
    if args.tokenize:
        print(json.dumps(tokenize_prompts(args.tokenize, args.repeats)))
        return

    runs, toks = [], []
    for r in range(args.repeats):
        runs.append(one_run(args.data, args.games, args.concurrency, args.workers))
        toks.append(tokenize_elsewhere(runs[-1]["prompts"]))
        ms = {p: 1000 * s / runs[-1]["steps"] for p, s in runs[-1]["parts"].items()}
        n = len(runs[-1]["prompts"])
        print(f"repeat {r}: {runs[-1]['steps']} steps, won {runs[-1]['won']}, "
              + ", ".join(f"{p} {ms[p]:.3f} ms" for p in PARTS)
              + f", tokenization whole {1000 * toks[-1]['whole'][0] / n:.3f} ms, incremental "
              f"{1000 * toks[-1]['incremental'][0] / n:.3f} ms", flush=True)  # fmt: skip
    steps = runs[-1]["steps"]
    tok = toks[-1]
    tok["whole"] = [t["whole"][0] for t in toks]
    tok["incremental"] = [t["incremental"][0] for t in toks]
    n_prompts = len(runs[-1]["prompts"])
    med = statistics.median
    per_step = {p: med(1000 * run["parts"][p] / run["steps"] for run in runs) for p in PARTS}
    whole = med(1000 * t / len(run["prompts"]) for t, run in zip(tok["whole"], runs, strict=True))
    inc = med(
        1000 * t / len(run["prompts"]) for t, run in zip(tok["incremental"], runs, strict=True)
    )
    frontend = sum(per_step[p] for p in PARTS if p != "scripted text")
    print(
        f"\n{args.games} valid_seen games, {args.concurrency} in flight, {args.workers} env "
        f"workers, {steps} steps ({n_prompts} actor prompts, median "
        f"{tok['median_prompt_tokens']:.0f} tokens, vocabulary {tok['vocab']}), medians of "
        f"{args.repeats}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    print("runner CPU per step (ms, share of engine+store+prompt+tokenization):")
    for label, ms in [*((p, per_step[p]) for p in PARTS[:3]), ("tokenization, whole", whole)]:
        print(f"  {label:<22} {ms:8.3f}   {ms / (frontend + whole) * 100:5.1f}%")
    print(f"  {'scripted text':<22} {per_step['scripted text']:8.3f}   (the model's stand-in)")
    print(
        f"tokenization whole {whole:.3f} ms vs incremental {inc:.3f} ms per step "
        f"({whole / inc:.1f}x); frontend per step {frontend + whole:.3f} ms whole vs "
        f"{frontend + inc:.3f} ms incremental ({(frontend + whole) / (frontend + inc):.2f}x)"
    )
    c = tok["counts"]
    print(f"incremental ids checked against whole: {c['spliced']} spliced, {c['whole']} tokenized "
          f"whole, {c['mismatched']} spliced results differed (whole used)")  # fmt: skip


if __name__ == "__main__":
    main()
