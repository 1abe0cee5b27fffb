"""Ray for reflexsim: the connection (``--ray ADDRESS|local``), what a job or a served model
reserves, and the env pool on actors. ``pip install reflexsim[ray]``; Ray is imported here, in
:mod:`experiments.cluster`, in :mod:`experiments.serve` (replicas), in :mod:`experiments.shards`
(runner processes) and in :mod:`envs.ray_pool` only, when ``--ray`` asks for it.

``--ray ADDRESS`` connects to a running cluster (``auto``, ``host:port``, ``ray://host:10001``);
``--ray local`` starts a private one on this machine, for this command only. The code the
workers import is the driver's: when it runs from a source checkout, the checkout is put first
on the workers' ``PYTHONPATH`` (so a checkout on shared storage needs no install on the nodes);
otherwise every node needs the same ``reflexsim`` installed. Workers get the environment of the
``ray start`` that started their node (API keys, ``$ALFWORLD_DATA``): export it there.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agents.llm.base import MissingDependencyError
from experiments.config import RunConfig
from experiments.errors import ConfigError

log = logging.getLogger("reflexsim.cluster")

_PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp", "-pp": "pp",
    "--data-parallel-size": "dp", "-dp": "dp",
}  # fmt: skip


# -- connecting --------------------------------------------------------------------------------
def import_ray() -> Any:
    """The ``ray`` module, or the one-line error naming the extra."""
    try:
        import ray  # lazily: ray is an optional extra
    except ImportError:
        raise MissingDependencyError("ray", "ray") from None
    return ray


def _runtime_env() -> dict[str, Any]:
    """Workers import the driver's code when it runs from a source checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        return {}
    path = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(path)}}


def connect(address: str) -> bool:
    """Connect to the cluster at ``address`` (``local``: start a private one); False when this
    process is connected already (e.g. it is a Ray task)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"runtime_env": _runtime_env(), "logging_level": logging.WARNING}
    with _own_sigterm():
        if address == "local":
            ray.init(address="local", include_dashboard=False, **options)
            return True
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"cannot connect to the Ray cluster at {address!r} ({first}): start it with "
                "`ray start --head` (see scripts/slurm/), or use --ray local"
            ) from None
    return True


@contextmanager
def _own_sigterm() -> Iterator[None]:
    """The process's SIGTERM handler as it was before the block: ``ray.init`` puts in one that
    exits at once (``sys.exit``), which would end a run without its orderly interruption."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


@contextmanager
def session(address: str) -> Iterator[Any]:
    """Connected to Ray while the block runs; disconnects (and stops a ``local`` cluster) only
    if it connected."""
    started = connect(address)
    ray = import_ray()
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


# -- env workers --------------------------------------------------------------------------------
def ray_env_pool(cfg: RunConfig, spec: Any, slots: int) -> Any:
    """A :class:`envs.ray_pool.RayEnvPool` for a run with ``env_workers_on_ray``; it connects to
    ``--ray`` first when this process is not connected yet (and disconnects when closed)."""
    from envs.ray_pool import RayEnvPool  # lazily: envs loads gymnasium and numpy

    address = cfg.cluster.address
    if not address:
        raise ConfigError("--env-workers-on-ray needs --ray ADDRESS (or --ray local)")
    started = connect(address)
    ray = import_ray()
    try:
        workers = min(cfg.execution.workers, slots)
        need = workers * cfg.cluster.env_worker_cpus
        have = float(ray.cluster_resources().get("CPU", 0.0))
        if need > have:
            raise ConfigError(
                f"{workers} Ray env workers of {cfg.cluster.env_worker_cpus:g} CPU need {need:g} "
                f"CPUs; the cluster has {have:g}: lower --workers or --env-worker-cpus"
            )
        return RayEnvPool(
            spec,
            workers=cfg.execution.workers,
            timeout_s=cfg.execution.step_timeout_s,
            slots=slots,
            cpus_per_worker=cfg.cluster.env_worker_cpus,
            on_close=ray.shutdown if started else None,
        )
    except BaseException:
        if started:
            ray.shutdown()
        raise


# -- resources ----------------------------------------------------------------------------------
def model_gpus(cfg: RunConfig) -> float:
    """GPUs one copy of the job's model needs: ``gpus`` if set; for a ``vllm:`` model the
    product of the parallel sizes its server command (or in-process options) asks for, at
    least 1; else 0."""
    if cfg.cluster.gpus is not None:
        return cfg.cluster.gpus
    if not cfg.models.model.strip().lower().startswith("vllm:"):
        return 0.0
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    if cfg.server.serve:
        words = shlex.split(cfg.server.serve_command or "")
        for i, word in enumerate(words):
            flag, eq, value = word.partition("=")
            if flag in _PARALLEL_FLAGS:
                text = value if eq else (words[i + 1] if i + 1 < len(words) else "1")
                sizes[_PARALLEL_FLAGS[flag]] = int(text) if text.isdigit() else 1
        if cfg.server.serve_data_parallel > 1:  # --serve-data-parallel adds vLLM's flag
            sizes["dp"] = cfg.server.serve_data_parallel
    else:
        options = cfg.models.backend_options
        sizes["tp"] = int(options.get("tensor_parallel_size", 1))
        sizes["pp"] = int(options.get("pipeline_parallel_size", 1))
    return float(max(1, sizes["tp"] * sizes["pp"] * sizes["dp"]))


def gpu_options(cfg: RunConfig, gpus: float) -> dict[str, Any]:
    if gpus <= 0:
        return {"num_gpus": 0}
    if cfg.cluster.gpu_resource == "GPU":
        return {"num_gpus": gpus}
    return {"num_gpus": 0, "resources": {cfg.cluster.gpu_resource: gpus}}


def job_resources(cfg: RunConfig) -> dict[str, Any]:
    """The Ray options of a job's task: CPUs for its env workers (``job_cpus``; default its
    ``workers``, or 1 when they are Ray actors) and its model's GPUs (none when the model is
    served by replicas, which reserve their own)."""
    cpus = cfg.cluster.job_cpus
    if cpus is None:
        cpus = 1.0 if cfg.cluster.env_workers_on_ray else float(cfg.execution.workers)
    replicas = cfg.server.serve and cfg.cluster.serve_replicas > 1
    return {"num_cpus": cpus, **gpu_options(cfg, 0.0 if replicas else model_gpus(cfg))}


def describe_resources(options: dict[str, Any]) -> str:
    """Task options in words: ``1 CPU, 2 GPU``."""
    parts = [f"{options['num_cpus']:g} CPU"]
    if options.get("num_gpus"):
        parts.append(f"{options['num_gpus']:g} GPU")
    for name, amount in options.get("resources", {}).items():
        parts.append(f"{amount:g} {name}")
    return ", ".join(parts)


def check_fits(name: str, options: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    """A one-line error when no node of the cluster could ever hold a job's resources."""
    need = {"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0)}
    need.update(options.get("resources", {}))
    for node in nodes:
        have = node.get("Resources", {})
        if all(have.get(k, 0.0) >= v for k, v in need.items() if v > 0):
            return
    largest = "; ".join(
        ", ".join(f"{v:g} {k}" for k, v in sorted(n.get("Resources", {}).items())
                  if k in need) or "nothing"
        for n in nodes
    )  # fmt: skip
    raise ConfigError(
        f"job {name} needs {describe_resources(options)} on one node, and no node of the Ray cluster has "
        f"them (nodes: {largest or 'none'}): lower --workers, --job-cpus or --gpus, or add nodes"
    )
