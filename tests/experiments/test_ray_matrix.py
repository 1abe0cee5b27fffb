"""The preset matrix on a real two-node Ray cluster (a custom resource, ``fake_gpu``, stands in for
the head node's GPU): jobs go where their resources are and record it, their episodes equal the
same matrix run without Ray, a removed node's job is re-run and resumed with nothing lost or
duplicated, served replicas start on the cluster, and bad setups are one-line errors."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from experiments import cluster as ray_cluster_module
from experiments import matrix
from experiments.cli import main
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.store import RunStore
from tests.experiments.test_experience_phases import write_preset as phases_preset
from tests.experiments.test_runner import snapshot, steps_written
from tests.support.raycluster import ray_cluster

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = "eval_out_of_distribution"
JOBS = {"big-reflexion": 1, "big-react": 1, "small-reflexion": 0, "small-react": 0}  # fake GPUs


def write_preset(path: Path, games: Path, **base: Any) -> Path:
    jobs = [
        {"name": name, "agent": name.split("-")[1], **({"gpus": gpus} if gpus else {})}
        for name, gpus in JOBS.items()
    ]
    values = {
        "model": "scripted:learner", "data": str(games), "split": SPLIT, "games": 2,
        "trials": 2, "workers": 1, "concurrency": 2, "gpu_resource": "fake_gpu", **base,
    }  # fmt: skip
    path.write_text(json.dumps({"description": "ray test", "base": values, "jobs": jobs}))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with ray_cluster({"num_cpus": 1, "resources": {"fake_gpu": 1}}, {"num_cpus": 1}) as c:
        yield c


@pytest.fixture(scope="module")
def preset(generated_games, tmp_path_factory) -> matrix.Preset:
    path = write_preset(tmp_path_factory.mktemp("preset") / "ladder.yaml", generated_games)
    return matrix.load_preset(str(path))


@pytest.fixture(scope="module")
def reference(preset, tmp_path_factory) -> dict[str, dict]:
    """The same matrix without Ray: each job's snapshot."""
    result = matrix.run_matrix(preset, {}, tmp_path_factory.mktemp("local") / "m")
    assert not result.failed
    return {name: snapshot(Path(r["run_dir"])) for name, r in result.jobs.items()}


def node_ids(cluster: Any) -> tuple[str, str]:
    head = cluster.head_node.node_id
    (other,) = [n.node_id for n in cluster.worker_nodes]
    return head, other


def test_without_the_extra_ray_is_a_one_line_error_naming_it(preset, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra sees
    run_dir = tmp_path / "m"
    code = main(["run", "--config", str(preset.path), "--ray", "local", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "pip install reflexsim[ray]" in err and "\n" not in err
    assert not run_dir.exists()  # nothing was written


def test_jobs_go_where_their_resources_are_and_equal_the_run_without_ray(
    cluster, preset, reference, tmp_path
):
    result = matrix.run_matrix(preset, {"ray": cluster.address}, tmp_path / "m")
    head, _ = node_ids(cluster)
    state = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert state["ray"] == cluster.address
    assert {n: r["status"] for n, r in result.jobs.items()} == dict.fromkeys(JOBS, "complete")
    for name, gpus in JOBS.items():
        record = state["jobs"][name]
        assert (
            record["node"]["node_id"]
            and record["attempts"][-1]["node_id"] == record["node"]["node_id"]
        )
        if gpus:  # only the head node holds a fake GPU
            assert record["node"]["node_id"] == head
            assert record["resources"] == "1 CPU, 1 fake_gpu"
        placement = json.loads((Path(record["run_dir"]) / "placement.json").read_text())
        assert [a["attempt"] for a in placement] == [1]
        store = RunStore(Path(record["run_dir"]), readonly=True)
        try:
            assert store.get_meta("placement") == placement  # the run store records it too
        finally:
            store.close()
        assert snapshot(Path(record["run_dir"])) == reference[name], name
    assert result.report is not None and (result.report / "comparison.json").is_file()


def test_setups_that_cannot_work_are_one_line_errors(cluster, generated_games, tmp_path):
    greedy = matrix.load_preset(str(write_preset(tmp_path / "p.yaml", generated_games, gpus=2)))
    with pytest.raises(ConfigError, match=r"job small-reflexion needs 1 CPU, 2 fake_gpu on one"):
        matrix.run_matrix(greedy, {"ray": cluster.address}, tmp_path / "m")

    # each node must see the driver's directory (the same filesystem) and write there
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / ".storage-t1").write_text("another")
    assert "not the same filesystem" in str(ray_cluster_module._probe_storage(str(shared), "t1"))
    assert "cannot read" in str(ray_cluster_module._probe_storage(str(tmp_path / "no"), "t1"))
    (shared / ".storage-t2").write_text("t2")
    assert ray_cluster_module._probe_storage(str(shared), "t2") is None
    import ray

    ray_cluster_module.check_shared_storage(shared, ray)  # every node of the cluster sees it
    assert sorted(p.name for p in shared.iterdir()) == [".storage-t1", ".storage-t2"]


def test_a_job_that_reads_another_s_run_starts_once_it_completed(
    cluster, train_games, generated_games, tmp_path
):
    """On Ray every job is submitted at once, but one that is shown another job's experience
    is held until that job completed: it extracts the rules of a finished gathering run."""
    path = phases_preset(tmp_path / "p.json", train_games, generated_games)
    result = matrix.run_matrix(
        matrix.load_preset(str(path)), {"ray": cluster.address}, tmp_path / "m"
    )
    jobs = result.jobs
    assert {n: r["status"] for n, r in jobs.items()} == dict.fromkeys(jobs, "complete")
    assert jobs["insights"]["started_at"] >= jobs["gather"]["finished_at"]
    with RunStore(Path(jobs["gather"]["run_dir"]), readonly=True) as store:
        assert [r["task_type"] for r in store.get_meta("insights")["rules"]] == ["heat"]


# A stand-in `vllm serve` that listens on the address it is given (a replica on a node).
STAND_IN = """
import signal, sys
sys.path.insert(0, {root!r})
from tests.support.fault_server import FaultServer
FaultServer(host=sys.argv[1], port=int(sys.argv[2])).start()
signal.pause()
"""


def test_served_replicas_start_on_the_cluster_and_serve_the_run(cluster, generated_games, tmp_path):
    from experiments.serve import free_port
    from experiments.session import RunSession

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.format(root=str(ROOT)))
    cfg = RunConfig.of(
        model="vllm:fault-model", serve=True, serve_replicas=2, ray=cluster.address, gpus=0,
        serve_command=f"{{python}} {shlex.quote(str(script))} {{host}} {{port}}",
        serve_port=free_port(), serve_timeout_s=120, data=str(generated_games), split=SPLIT,
        games=2, trials=1, max_steps=3, run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    run_dir = RunSession(cfg).run()
    store = RunStore(run_dir, readonly=True)
    try:
        replicas = store.get_meta("server")["replicas"]
        urls = store.get_meta("manifest")["config"]["base_url"].split(",")
        assert len(store.episodes()) == 2 and store.model_calls()
    finally:
        store.close()
    assert sorted(urls) == sorted(r["url"] for r in replicas) and len(set(urls)) == 2
    assert all(r["restarts"] == 0 and not r["failed"] for r in replicas)
    assert all("[reflexsim serve] stopped" in Path(r["log"]).read_text() for r in replicas)


def test_a_removed_node_s_job_is_re_run_and_resumed_with_nothing_lost(
    cluster, preset, reference, tmp_path
):
    """The last test of the module: the cluster has one node left afterwards."""
    head, other = node_ids(cluster)
    root = tmp_path / "m"
    outcome: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: outcome.update(result=matrix.run_matrix(preset, {"ray": cluster.address}, root))
    )  # fmt: skip
    runner.start()
    victim: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    while runner.is_alive() and not victim and time.monotonic() < deadline:
        for name in JOBS:
            job_dir = root / name
            placed = ray_cluster_module.read_placement(job_dir)
            if placed and placed[-1]["node_id"] == other and steps_written(job_dir) >= 1:
                if matrix.job_status(job_dir) == "complete":
                    continue
                # the node dies with everything on it: freeze its job, drop the node, kill the job
                os.kill(placed[-1]["pid"], signal.SIGSTOP)
                cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
                os.kill(placed[-1]["pid"], signal.SIGKILL)
                victim.update(name=name, steps=steps_written(job_dir))
                break
        time.sleep(0.05)
    runner.join(timeout=600)
    assert victim, "no job was caught mid-run on the second node"
    result = outcome["result"]
    assert {n: r["status"] for n, r in result.jobs.items()} == dict.fromkeys(JOBS, "complete")
    record = result.jobs[victim["name"]]
    first, *later = record["attempts"]
    assert first["node_id"] == other and "NodeDiedError" in first["lost"]
    assert later and {a["node_id"] for a in later} == {head} and "lost" not in later[-1]
    assert record["node"]["node_id"] == head
    store = RunStore(Path(record["run_dir"]), readonly=True)
    try:
        assert store.event_counts().get("resume", 0) >= 1  # it continued from its run store
    finally:
        store.close()
    for name in JOBS:  # same episodes, steps and reflections; no row lost or duplicated
        assert snapshot(root / name) == reference[name], name


def test_a_job_reserves_its_model_s_gpus_and_its_env_workers_cpus():
    from experiments.ray_session import job_resources, model_gpus
    from experiments.serve import serve_template

    def cfg(**kw: Any) -> RunConfig:
        return RunConfig.of(**kw)

    command = "vllm serve {model} --host {host} --port {port} --tensor-parallel-size 2 -dp=2"
    assert model_gpus(cfg(model="vllm:m", serve=True, serve_command=command)) == 4
    assert model_gpus(cfg(model="vllm:m", serve=True, serve_data_parallel=3)) == 3
    assert model_gpus(cfg(model="vllm:m", backend_options={"tensor_parallel_size": 2})) == 2
    assert model_gpus(cfg(model="vllm:m")) == 1
    assert model_gpus(cfg(model="openai:gpt-4o-mini")) == 0
    assert model_gpus(cfg(model="openai:gpt-4o-mini", gpus=0.5)) == 0.5
    assert job_resources(cfg(model="vllm:m", serve=True, workers=4)) == {
        "num_cpus": 4.0, "num_gpus": 1.0,
    }  # fmt: skip
    on_ray = {"ray": "local", "env_workers_on_ray": True, "gpu_resource": "a100"}
    assert job_resources(cfg(model="scripted:expert", gpus=1, workers=8, **on_ray)) == {
        "num_cpus": 1.0, "num_gpus": 0, "resources": {"a100": 1.0},
    }  # fmt: skip
    replicas = cfg(model="vllm:m", serve=True, ray="local", serve_replicas=2)
    assert job_resources(replicas)["num_gpus"] == 0  # the replicas reserve the GPUs

    # vLLM's own data parallelism behind the one served URL
    served = cfg(model="vllm:Qwen/Qwen2.5-7B-Instruct", serve=True, serve_data_parallel=4)
    assert serve_template(served).endswith("--enable-prompt-tokens-details --data-parallel-size 4")
    plan = matrix.plan_job(served.replace(ray="10.0.0.1:6379"), needs_data=True)
    assert plan["serve"]["command"].endswith("--data-parallel-size 4")
    assert plan["ray"] == {"address": "10.0.0.1:6379", "reserves": "1 CPU, 4 GPU"}
    with pytest.raises(ConfigError, match="already sets --data-parallel-size"):
        serve_template(served.replace(serve_command=f"{command} --data-parallel-size 2"))
    assert RunConfig.of(ray="off").cluster.address is None
