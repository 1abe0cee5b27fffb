"""README line 1's workload, old llama.cpp defaults against new, side by side in one run.

The workload is ``python run_alfworld.py``'s: the embedded Gemma 3 270M in process, Reflexion on
the generated games, seed 0, greedy, 4 episodes in flight; ``--games``, ``--trials`` and
``--max-steps`` take a slice of it (the whole is 6 games, 3 trials, 30 steps). Each setting
plays the same slice, ``--repeats`` times, the settings taking turns:

- ``old``: two rounds ago: ``n_batch=512``, any cached prefix reused (no replay: a sample
  depended on what its slot served before), and a prompt took any slot it shared a token with
  before a new slot was made;
- ``base``: the base commit: whole 128-token blocks, the same routing;
- ``new-N``: whole ``N``-token blocks (``n_batch=N``) and each episode on its own slot (a prompt
  without one takes a fresh slot while there is room), the slots of a batch run at once (one per
  core, each with its share of the cores: the default); ``new-N-pK``: at most ``K`` at once
  (``new-128-p1``: one at a time, llama-cpp-python's threads, as the base commit ran them).

Printed: per setting, per actor call (means): prompt tokens evaluated and cached, seconds, and
how llama.cpp's own counters split the model time (prompt evaluation, decoding); the share of
the model time spent in reflection and judge calls; slots made; wall time (median of repeats) and
its ratio to the first setting's (``--settings``: default base, new-128-p1, new-128, new-64).
llama.cpp's prompt and decode seconds are summed over the slots (slots running at once overlap).
Then the
kernel, for the choice of ``n_batch`` and threads: prompt evaluation tokens/s of a 1,500-token
prompt at each ``n_batch`` and ``n_threads_batch``, and decoding tokens/s at each ``n_threads``
(medians of repeats). On a shared machine compare ratios.

    python benchmarks/bench_first_command.py [--games 4] [--trials 2] [--max-steps 10]
        [--repeats 1] [--settings old base new-128-p1 new-128] [--skip-kernel]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402

from agents.llm import llamacpp_backend  # noqa: E402
from agents.llm.llamacpp_backend import (  # noqa: E402
    LlamaCppBackend,
    embedded_model_path,
    own_slot,
)
from experiments.config import RunConfig  # noqa: E402
from experiments.session import run  # noqa: E402
from experiments.store import open_reader  # noqa: E402


class Measured(LlamaCppBackend):
    """The backend, keeping llama.cpp's own counters of each slot when it closes."""

    counters: dict[str, float] = {}

    def close(self) -> None:
        import llama_cpp

        totals = {"prompt_s": 0.0, "prompt_tokens": 0.0, "decode_s": 0.0, "decode_tokens": 0.0}
        for slot in self._slots:
            perf = llama_cpp.llama_perf_context(slot.llm.ctx)
            totals["prompt_s"] += perf.t_p_eval_ms / 1000
            totals["prompt_tokens"] += perf.n_p_eval
            totals["decode_s"] += perf.t_eval_ms / 1000
            totals["decode_tokens"] += perf.n_eval
        totals["slots"] = len(self._slots)
        Measured.counters = totals
        super().close()


class BaseDefaults(Measured):
    """The base commit: whole n_batch blocks, routed as two rounds ago: a prompt took the
    unclaimed slot sharing the longest prefix with it, any shared token counting (the BOS
    token, the instruction), and a new slot only when it shared nothing with every one."""

    def _route(
        self, prompts: Sequence[Sequence[int]], owns: Callable[[int, int], bool] = own_slot
    ) -> list[int]:
        return super()._route(prompts, lambda shared, held: shared > 0)


class OldDefaults(BaseDefaults):
    """Two rounds ago: any cached prefix reused (one-token blocks), routed as then."""

    @property
    def block(self) -> int:
        return 1


SETTINGS: dict[str, tuple[type[Measured], int]] = {
    "old": (OldDefaults, 512),
    "base": (BaseDefaults, 128),
}


@contextlib.contextmanager
def backend_class(cls: type[LlamaCppBackend]) -> Iterator[None]:
    """``embedded`` builds ``cls`` while the block lasts."""
    saved = llamacpp_backend.LlamaCppBackend
    llamacpp_backend.LlamaCppBackend = cls  # type: ignore[misc]
    try:
        yield
    finally:
        llamacpp_backend.LlamaCppBackend = saved  # type: ignore[misc]


def setting(name: str) -> tuple[type[Measured], dict[str, int]]:
    """The backend class and options of a setting's name (see the module docstring)."""
    if name in SETTINGS:
        cls, n_batch = SETTINGS[name]
        return cls, {"n_batch": n_batch, "parallel": 1}  # one slot at a time, as then
    parts = name.split("-")
    options = {"n_batch": int(parts[1])}
    if len(parts) > 2:
        options["parallel"] = int(parts[2].removeprefix("p"))
    return Measured, options


def play(args: argparse.Namespace, name: str, run_dir: Path) -> dict[str, float]:
    cls, options = setting(name)
    cfg = RunConfig.of(
        model="embedded",
        games=args.games,
        trials=args.trials,
        max_steps=args.max_steps,
        backend_options=options,
        run_dir=str(run_dir),
    )
    start = time.perf_counter()
    with backend_class(cls):
        run(cfg)
    wall = time.perf_counter() - start
    with open_reader(run_dir) as reader:
        calls = reader.model_calls()
    acts = [c for c in calls if c.purpose == "act"]
    model_s = sum(c.latency_s for c in calls)
    other = sum(c.latency_s for c in calls if c.purpose in ("reflect", "judge"))
    n = max(len(acts), 1)
    return {
        "wall_s": wall,
        "acts": len(acts),
        "evaluated": sum(c.prompt_tokens - c.cached_tokens for c in acts) / n,
        "cached": sum(c.cached_tokens for c in acts) / n,
        "act_s": sum(c.latency_s for c in acts) / n,
        "reflect_calls": len(calls) - len(acts),
        "reflect_share": other / model_s if model_s else 0.0,
        **Measured.counters,
    }


def workload(args: argparse.Namespace) -> None:
    names = args.settings
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in names:
                results[name].append(play(args, name, Path(tmp) / f"{name}-{r}"))
                print(
                    f"  played {name} (repeat {r}): {results[name][-1]['wall_s']:.0f} s", flush=True
                )
    print(
        f"\nREADME line 1's workload, a slice: {args.games} games x {args.trials} trials, "
        f"at most {args.max_steps} steps; means per actor call; wall: median of {args.repeats}"
    )
    head = (
        f"{'setting':<12}{'calls':>6}{'evaluated':>10}{'cached':>8}{'s/call':>8}{'prompt s':>9}"
        f"{'decode s':>9}{'refl/judge':>11}{'slots':>6}{'wall s':>8}  {names[0] + '/this':>14}"
    )
    print(head)
    first = statistics.median(x["wall_s"] for x in results[names[0]])
    for name in names:
        runs = results[name]
        x = runs[-1]
        wall = statistics.median(y["wall_s"] for y in runs)
        acts = max(x["acts"], 1)
        print(
            f"{name:<12}{x['acts']:>6.0f}{x['evaluated']:>10.0f}{x['cached']:>8.0f}"
            f"{x['act_s']:>8.2f}{x['prompt_s'] / acts:>9.2f}{x['decode_s'] / acts:>9.2f}"
            f"{x['reflect_share']:>10.0%}{x['slots']:>6.0f}{wall:>8.0f}  {first / wall:>14.2f}"
        )
    print(
        "(prompt s, decode s: llama.cpp's counters over all calls, per actor call; refl/judge: "
        "the share of model time in reflection and judge calls)"
    )


def kernel(args: argparse.Namespace) -> None:
    import llama_cpp

    path = str(embedded_model_path("gemma3-270m"))
    text = (ROOT / "README.md").read_text()
    print(
        "\nkernel: prompt evaluation of a 1,500-token prompt, decoding one token at a time after"
        " 1,400 (a step's context)"
    )
    for threads in (1, 2):
        for n_batch in (64, 128, 256, 512):
            llm = llama_cpp.Llama(
                model_path=path,
                n_ctx=2048,
                n_batch=n_batch,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            tokens = llm.tokenize(text.encode(), add_bos=True)[:1500]

            def prompt(llm: Any = llm, tokens: list[int] = tokens) -> None:
                llm.n_tokens = 0
                llm.eval(tokens)

            def decode(llm: Any = llm, tokens: list[int] = tokens) -> None:
                # at a step's context length (the prompt() before it left 1,500 tokens cached)
                llm.n_tokens = 1400
                for t in tokens[1400:1416]:
                    llm.eval([t])

            p = median_time(prompt, args.kernel_repeats)
            line = f"  threads {threads}, n_batch {n_batch:>3}: prompt {len(tokens) / p:6.0f} tok/s"
            if n_batch == 128:  # decoding does not depend on n_batch
                d = median_time(decode, args.kernel_repeats)
                line += f", decode {16 / d:5.1f} tok/s"
            print(line, flush=True)
            llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--games", type=int, default=4)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["base", "new-128-p1", "new-128", "new-64"],
        help="old, base, new-N, new-N-pK",
    )
    parser.add_argument("--kernel-repeats", type=int, default=3)
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-workload", action="store_true")
    args = parser.parse_args()
    if not args.skip_workload:
        workload(args)
    if not args.skip_kernel:
        kernel(args)


if __name__ == "__main__":
    main()
