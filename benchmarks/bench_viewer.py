"""Viewer, report and progress-line costs on a run of the paper's size (134 tasks, 5 trials).

Prints medians of repeats and ratios measured in one run:
- the outcome query the report and task list use vs loading full episode rows (with prompts);
- the progress line after an episode: solved count and tokens from ``progress()`` (an index and
  the running call totals) vs re-reading every episode and summing every recorded call;
- /api/run and /api/episode latency, idle vs while a writer commits steps (WAL readers);
- write_report time and the static index.html size.

Usage: python benchmarks/bench_viewer.py [--tasks 134] [--trials 5] [--repeats 7]
"""

from __future__ import annotations

import argparse
import http.client
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the test runs: tests/support

from timing import median_time  # noqa: E402

from experiments.report import write_report  # noqa: E402
from experiments.store import RunStore, episode_id, open_reader  # noqa: E402
from experiments.viewer import serve  # noqa: E402
from memory.records import ModelCall  # noqa: E402
from tests.support.runfactory import TaskPlan, episode_steps, game_id, make_run  # noqa: E402

TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")


def median_ms(fn, repeats: int) -> float:
    return 1000 * median_time(fn, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=134)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-viewer-") as d:
        bench(a, Path(d))


def bench(a: argparse.Namespace, tmp: Path) -> None:
    plans = [
        TaskPlan(game_id(TYPES[i % 6], i), TYPES[i % 6],
                 tuple("won" if k == i % (a.trials + 1) else "fail:repeated_action" for k in range(a.trials)))
        for i in range(a.tasks)
    ]  # fmt: skip
    t = time.perf_counter()
    run = make_run(tmp / "run", plans, trials=a.trials)
    print(f"built run: {a.tasks} tasks x {a.trials} trials in {time.perf_counter() - t:.1f} s")

    writer = RunStore(run)  # the engine records one act call per step
    for eid, steps in writer.all_steps().items():
        game, trial = eid.rsplit("#t", 1)
        for s in steps:
            writer.add_model_call(ModelCall("act", game, int(trial), eid, s.prompt_tokens,
                                            s.completion_tokens, s.cached_tokens, s.latency_s))  # fmt: skip
    writer.close()

    reader = open_reader(run)
    light = median_ms(reader.outcomes, a.repeats)
    full = median_ms(reader.episodes, a.repeats)
    n = len(reader.episodes())
    print(f"{n} episodes: outcome query {light:.1f} ms vs full rows {full:.1f} ms"
          f" -> full/light = {full / light:.1f}x")  # fmt: skip

    raw = sqlite3.connect(f"file:{run / 'run.sqlite'}?mode=ro", uri=True)
    calls = raw.execute("SELECT COUNT(*) FROM model_calls").fetchone()[0]

    def rescan() -> tuple[int, int]:
        solved = len({e.game for e in reader.episodes() if e.won})
        p, c = raw.execute(
            "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM model_calls"
        ).fetchone()
        return solved, p + c

    assert rescan() == (reader.progress().solved, reader.progress().tokens)
    scan, cheap = median_ms(rescan, a.repeats), median_ms(reader.progress, a.repeats)
    raw.close()
    reader.close()
    print(f"progress line ({calls} calls): re-read {scan:.2f} ms vs progress() {cheap:.3f} ms"
          f" -> {scan / cheap:.0f}x")  # fmt: skip

    eid = episode_id(plans[0].game, 0)
    with serve(run) as srv:

        def get(path: str) -> None:
            c = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            c.request("GET", path)
            c.getresponse().read()
            c.close()

        api_run = lambda: get("/api/run")  # noqa: E731
        api_ep = lambda: get("/api/episode?id=" + quote(eid, safe=""))  # noqa: E731
        idle_run, idle_ep = median_ms(api_run, a.repeats), median_ms(api_ep, a.repeats)
        stop = threading.Event()
        live = episode_id(plans[1].game, a.trials)  # a new episode being played now
        writer = RunStore(run)
        writer.start_episode(episode_id=live, game=plans[1].game, task_type=plans[1].task_type,
                             trial=a.trials, arm="reflexion", prompt_prefix="p", observation="o",
                             task="t", memory=())  # fmt: skip
        written = [0]

        def write() -> None:
            step = episode_steps("fail:other")[1]
            while not stop.is_set():
                writer.add_step(live, step.__class__(**{**step.to_dict(), "index": written[0]}))
                written[0] += 1
                time.sleep(0.002)

        th = threading.Thread(target=write)
        th.start()
        busy_run, busy_ep = median_ms(api_run, a.repeats), median_ms(api_ep, a.repeats)
        stop.set()
        th.join()
        writer.close()
    print(f"/api/run     idle {idle_run:.1f} ms, writer active {busy_run:.1f} ms"
          f" -> {busy_run / idle_run:.2f}x")  # fmt: skip
    print(f"/api/episode idle {idle_ep:.1f} ms, writer active {busy_ep:.1f} ms"
          f" -> {busy_ep / idle_ep:.2f}x ({written[0]} steps committed meanwhile)")  # fmt: skip

    t = time.perf_counter()
    out = write_report([run])
    took = time.perf_counter() - t
    size = (out / "index.html").stat().st_size
    print(f"write_report: {took:.2f} s; index.html {size / 1e6:.2f} MB"
          f" ({size / n / 1e3:.1f} kB per episode, prompt prefixes stored once)")  # fmt: skip


if __name__ == "__main__":
    main()
