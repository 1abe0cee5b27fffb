"""What recording every model call as sent costs the run store, per step.

Plays a run (scripted policy, so only the harness and the store are measured), then compares in
one go the store as written (every call's request and answer kept, a step's prompt as what it
adds to the episode's last one) with the same store less that record (the columns dropped: the
store the code wrote before requests were recorded), both compacted with ``VACUUM INTO``.
Prints bytes per step before and after, what the record adds per step, the mean prompt length
and the mean new text per step (goal: the record adds no more than the step's new text plus a
small constant, far below the prompt length).

    python benchmarks/bench_record_size.py [--data DIR] [--games 140] [--trials 2]
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import data_parser

from experiments.store import DB_NAME, SENT_COLUMNS, open_reader

ROOT = Path(__file__).resolve().parent.parent
SPLIT = "eval_in_distribution"


def compact(db: Path, out: Path, drop: bool) -> int:
    """The size of ``db`` compacted into ``out`` (with the record of requests dropped)."""
    conn = sqlite3.connect(db)
    conn.execute("VACUUM INTO ?", (str(out),))
    conn.close()
    if drop:
        conn = sqlite3.connect(out)
        for column in SENT_COLUMNS:
            conn.execute(f"ALTER TABLE model_calls DROP COLUMN {column}")
        conn.commit()
        conn.execute("VACUUM")
        conn.close()
    return out.stat().st_size


def main() -> None:
    parser = data_parser(__doc__, ROOT)
    parser.add_argument("--games", type=int, default=140)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--model", default="scripted:random")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "run_alfworld.py"), "--model", args.model,
               "--agent", "reflexion", "--data", str(args.data), "--split", SPLIT,
               "--games", str(args.games), "--trials", str(args.trials),
               "--max-steps", str(args.max_steps), "--workers", "2", "--concurrency", "8",
               "--step-timeout-s", "600", "--run-dir", str(run_dir)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode not in (0, 3):  # 3: some episodes hit an env error; still measured
            sys.exit(f"the run failed ({done.returncode}): {done.stderr[-2000:]}")
        after = compact(run_dir / DB_NAME, Path(tmp) / "after.sqlite", drop=False)
        before = compact(run_dir / DB_NAME, Path(tmp) / "before.sqlite", drop=True)
        with open_reader(run_dir) as reader:
            steps = sum(len(s) for s in reader.all_steps().values())
            acts = [c for c in reader.model_calls() if c.purpose == "act" and c.sent]
            calls = len(reader.model_calls())
            stored = reader.conn.execute(
                "SELECT COALESCE(SUM(length(CAST(prompt_text AS BLOB))), 0) FROM model_calls"
                " WHERE purpose = 'act'"
            ).fetchone()[0]
        prompt = sum(len(c.sent.text.encode()) for c in acts if c.sent) / len(acts)
    added = (after - before) / steps
    new_text = stored / len(acts)
    print(f"run: {args.games} games x {args.trials} trials, {steps} steps, {calls} model calls"
          f" (exit code {done.returncode})")  # fmt: skip
    print(f"run.sqlite per step: before {before / steps:,.0f} B, after {after / steps:,.0f} B")
    print(f"added per step: {added:,.0f} B; the step's prompt: {prompt:,.0f} B (ratio "
          f"{added / prompt:.3f}); its new text: {new_text:,.0f} B (added - new text: "
          f"{added - new_text:,.0f} B)")  # fmt: skip


if __name__ == "__main__":
    main()
