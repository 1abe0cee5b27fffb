"""The GPU stand-in's calibration table (tests/support/gpu_standin.py), beside the worked figures.

Every number is the simulator's own arithmetic on its virtual clock (nothing here is timed):

- a decode iteration at batch 1, 32 and 128, contexts of 1,536 tokens: its time and tokens/s,
  beside the memory-bound figure from the published ones ((16 GB of weights + KV at 128 KiB a
  token) / 3.35 TB/s, the issue's ~12 ms at batch 128; an H200's at its 4.8 TB/s);
- a 4,096-token prompt prefilled alone, beside ~20-25k tokens/s;
- ReAct actor requests a second at batch 128 (20 output tokens, ~100 new prompt tokens after the
  prefix cache, contexts ~1.5k), beside the worked ~500/s: once with the prefill of the new
  tokens charged at the preset's rate, once decode only (the worked figure's arithmetic,
  128 / (20 x 12 ms); an H200's scaled by its bandwidth).

``--serve PORT`` instead serves the stand-in at http://127.0.0.1:PORT/v1 (``GET /stats``: the
busy time) until Ctrl-C, for a run's ``--base-url``.

    python benchmarks/bench_gpu_standin.py [--preset h100-8b] [--serve PORT --time-scale 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the stand-in lives with the test servers: tests/support

from tests.support.gpu_standin import (  # noqa: E402
    PRESETS,
    Engine,
    GpuPreset,
    actor_load,
    decode_step,
    standin_server,
)

CONTEXT = 1536
WORKED_REQUESTS_S = 500.0
PUBLISHED_WEIGHTS, PUBLISHED_KV, H100_HBM = 16e9, 128 * 1024, 3.35e12


def table(preset: GpuPreset) -> list[str]:
    rows = [
        f"{preset.name}: {preset.hbm_bytes_per_s / 1e12:.2f} TB/s, {preset.hbm_bytes / 1e9:.0f} GB, "
        f"KV cache {preset.kv_capacity_tokens:,} tokens, prefill {preset.prefill_tokens_per_s:,.0f} "
        f"tokens/s",
        "",
        "| what | stand-in | worked figure | ratio |",
        "|---|---|---|---|",
    ]
    for batch in (1, 32, 128):
        step = decode_step(preset, batch, CONTEXT)
        worked = (PUBLISHED_WEIGHTS + batch * CONTEXT * PUBLISHED_KV) / preset.hbm_bytes_per_s
        if batch == 128 and preset.hbm_bytes_per_s == H100_HBM:
            worked_text = f"{worked * 1e3:.1f} ms (issue: ~12 ms)"
        else:
            worked_text = f"{worked * 1e3:.1f} ms"
        rows.append(
            f"| decode, batch {batch}, ctx {CONTEXT} | {step.duration_s * 1e3:.1f} ms, "
            f"{batch / step.duration_s:,.0f} tokens/s | {worked_text}, {batch / worked:,.0f} "
            f"tokens/s | {step.duration_s / worked:.2f} |"
        )
    engine = Engine(preset)
    engine.add([f"t{i}" for i in range(4096)], ["<stop>"])
    prefill = engine.step()
    assert prefill is not None
    rate = 4096 / prefill.duration_s
    rows.append(
        f"| prefill, 4,096 tokens | {prefill.duration_s * 1e3:.0f} ms, {rate:,.0f} tokens/s | "
        f"20,000-25,000 tokens/s | {rate / 22_500:.2f} |"
    )
    free_prefill = dataclasses.replace(preset, prefill_tokens_per_s=math.inf)
    worked_requests = WORKED_REQUESTS_S * preset.hbm_bytes_per_s / H100_HBM
    for label, load in (
        ("prefill charged", actor_load(preset)),
        ("decode only", actor_load(free_prefill)),
    ):
        rows.append(
            f"| actor requests, batch 128, {label} (ctx {load.context:,.0f}, "
            f"{load.new_prompt_tokens:.0f} new prompt tokens, step {load.iteration_s * 1e3:.1f} "
            f"ms) | {load.requests_per_s:,.0f}/s | ~{worked_requests:.0f}/s | "
            f"{load.requests_per_s / worked_requests:.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append")
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve instead of printing")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--policy", default="random", help="a scripted: policy (default random)")
    args = parser.parse_args()
    presets = [PRESETS[name] for name in args.preset or sorted(PRESETS)]
    if args.serve is not None:
        with standin_server(
            presets[0], policy=args.policy, time_scale=args.time_scale, port=args.serve
        ) as server:
            print(f"{presets[0].name} at {server.url} (x{args.time_scale}); Ctrl-C ends it")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
        return
    for preset in presets:
        print("\n".join(table(preset)), end="\n\n")


if __name__ == "__main__":
    main()
