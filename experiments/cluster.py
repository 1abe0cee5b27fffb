"""Beyond one machine, on Ray: a preset's jobs as Ray tasks, env workers and served model replicas
as Ray actors. ``pip install reflexsim[ray]``; Ray is imported here (and in ``envs.ray_pool``)
only, when ``--ray`` asks for it.

``--ray ADDRESS`` connects to a running cluster (``auto``, ``host:port``, ``ray://host:10001``);
``--ray local`` starts a private one on this machine, for this command only. The code the
workers import is the driver's: when it runs from a source checkout, the checkout is put first
on the workers' ``PYTHONPATH`` (so a checkout on shared storage needs no install on the nodes);
otherwise every node needs the same ``reflexsim`` installed. Workers get the environment of the
``ray start`` that started their node (API keys, ``$ALFWORLD_DATA``): export it there.

The matrix (:func:`run_jobs`): every job that is not complete is submitted at once as a task
that reserves its resources (:func:`job_resources`: its model's GPUs, CPUs for its env
workers); Ray runs them in parallel where the resources allow. A job writes its run directory
under the matrix's directory, which must be storage every node sees at the same path: checked at
start (:func:`check_shared_storage`). A task whose node or worker dies is submitted again, up to
``job_retries`` times; the new attempt resumes the job from its run store (the runner's
``--resume``), after taking the job's lock, which the dead attempt's process held until it was
gone. Each attempt records where it ran in ``<job>/placement.json`` and in ``matrix.json``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shlex
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments.config import RunConfig, from_mapping
from experiments.errors import ConfigError, RunStoreError

log = logging.getLogger("reflexsim.cluster")

PLACEMENT_FILE = "placement.json"
LOCK_FILE = ".job.lock"
LOCK_WAIT_S = 600.0  # how long a new attempt waits for the lock of a job's previous attempt
PROBE_TIMEOUT_S = 180.0
_PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp", "-pp": "pp",
    "--data-parallel-size": "dp", "-dp": "dp",
}  # fmt: skip


# -- connecting --------------------------------------------------------------------------------
def import_ray() -> Any:
    """The ``ray`` module, or the one-line error naming the extra."""
    try:
        import ray
    except ImportError:
        from agents.llm.base import MissingDependencyError

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


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


# -- env workers --------------------------------------------------------------------------------
def ray_env_pool(cfg: RunConfig, spec: Any, slots: int) -> Any:
    """A :class:`envs.ray_pool.RayEnvPool` for a run with ``env_workers_on_ray``; it connects to
    ``--ray`` first when this process is not connected yet (and disconnects when closed)."""
    from envs.ray_pool import RayEnvPool

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
        from experiments.serve import serve_template

        words = shlex.split(serve_template(cfg))
        for i, word in enumerate(words):
            flag, eq, value = word.partition("=")
            if flag in _PARALLEL_FLAGS:
                text = value if eq else (words[i + 1] if i + 1 < len(words) else "1")
                sizes[_PARALLEL_FLAGS[flag]] = int(text) if text.isdigit() else 1
    else:
        options = cfg.models.backend_options
        sizes["tp"] = int(options.get("tensor_parallel_size", 1))
        sizes["pp"] = int(options.get("pipeline_parallel_size", 1))
    return float(max(1, sizes["tp"] * sizes["pp"] * sizes["dp"]))


def _gpu_options(cfg: RunConfig, gpus: float) -> dict[str, Any]:
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
    return {"num_cpus": cpus, **_gpu_options(cfg, 0.0 if replicas else model_gpus(cfg))}


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


# -- shared storage -----------------------------------------------------------------------------
def _probe_storage(root: str, token: str) -> str | None:
    """On one node: None when it sees the driver's directory ``root`` and can write there."""
    base = Path(root)
    try:
        seen = (base / f".storage-{token}").read_text()
    except OSError as exc:
        return f"cannot read {base} ({exc.strerror or exc})"
    if seen != token:
        return f"sees another directory at {base} (not the same filesystem)"
    mine = base / f".storage-{token}-{socket.gethostname()}-{os.getpid()}"
    try:
        mine.write_text(token)
        mine.unlink()
    except OSError as exc:
        return f"cannot write to {base} ({exc.strerror or exc})"
    return None


def check_shared_storage(root: Path, ray: Any) -> None:
    """Every live node reads and writes the matrix directory; else a one-line ConfigError."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    marker = root / f".storage-{token}"
    marker.write_text(token)
    probe = ray.remote(_probe_storage)
    try:
        nodes = _alive_nodes(ray)
        refs = {
            probe.options(
                num_cpus=0,
                max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote(str(root), token): n
            for n in nodes
        }
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        for ref in ready:
            problem = ray.get(ref)
            if problem is not None:
                node = refs[ref]
                raise ConfigError(
                    f"node {node['NodeManagerAddress']} ({node['NodeID'][:12]}) {problem}: "
                    "put --run-dir on storage every node mounts at the same path (NFS, Lustre)"
                )
        if late:
            node = refs[late[0]]
            raise ConfigError(
                f"node {node['NodeManagerAddress']} ({node['NodeID'][:12]}) did not check the "
                f"matrix directory {root} within {PROBE_TIMEOUT_S:g}s: is the node healthy?"
            )
    finally:
        marker.unlink(missing_ok=True)


# -- one job, on a node -------------------------------------------------------------------------
@contextmanager
def job_lock(job_dir: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """The job's lock: one attempt at a time plays a job. A dead attempt's lock goes with its
    process (on NFS, when the server notices the client is gone)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(job_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RunStoreError(
                        f"job {job_dir.name}: another process still holds {job_dir / LOCK_FILE} "
                        f"after {wait_s:g}s (an earlier attempt that is not dead?)"
                    ) from None
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def _where(ray: Any, attempt: int) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.time(),
    }


def read_placement(job_dir: Path) -> list[dict[str, Any]]:
    """The attempts recorded in a job's ``placement.json`` (where each one ran)."""
    try:
        data = json.loads((job_dir / PLACEMENT_FILE).read_text())
    except (OSError, ValueError):
        return []
    return list(data) if isinstance(data, list) else []


def _write_placement(job_dir: Path, attempts: list[dict[str, Any]]) -> None:
    tmp = job_dir / f".{PLACEMENT_FILE}.tmp"
    tmp.write_text(json.dumps(attempts, indent=1) + "\n")
    tmp.replace(job_dir / PLACEMENT_FILE)


def _job_task(
    values: dict[str, Any], force: bool, attempt: int, deadline: float | None
) -> dict[str, Any]:
    """A job's Ray task: take its lock, record where it runs, play (or resume) it."""
    import ray

    from experiments.matrix import play_job

    cfg = from_mapping(values, source="ray job")
    job_dir = Path(str(cfg.execution.run_dir))
    where = _where(ray, attempt)
    with job_lock(job_dir):
        attempts = [a for a in read_placement(job_dir) if a.get("attempt") != attempt]
        _write_placement(job_dir, [*attempts, where])
        if deadline is not None and time.time() >= deadline:
            return {
                "status": "pending",
                "note": "deadline reached before it started",
                "node": where,
            }
        fields = play_job(cfg, force)
        if (job_dir / "run.sqlite").is_file():  # the run store says where it ran, too
            from experiments.store import RunStore

            store = RunStore(job_dir)
            try:
                store.set_meta("placement", read_placement(job_dir))
            finally:
                store.close()
        return {**fields, "node": where}


# -- the matrix on Ray --------------------------------------------------------------------------
def run_jobs(
    preset_name: str,
    jobs: list[tuple[str, RunConfig]],
    root: Path,
    results: dict[str, dict[str, Any]],
    save: Callable[[], None],
    deadline_of: Callable[[RunConfig], float | None],
    force: bool,
) -> None:
    """Play a matrix's jobs as Ray tasks (see the module docstring); ``results`` gets each
    job's record (as in ``matrix.json``), ``save`` writes them."""
    from experiments.matrix import job_status

    address = str(jobs[0][1].cluster.address)
    with session(address) as ray:
        check_shared_storage(root, ray)
        nodes = _alive_nodes(ray)
        options = {name: job_resources(cfg) for name, cfg in jobs}
        for name, _ in jobs:
            check_fits(name, options[name], nodes)
        task = ray.remote(_job_task)
        pending: dict[Any, str] = {}
        configs = dict(jobs)
        lost: dict[str, int] = {}

        def submit(name: str) -> None:
            record = results[name]
            record["attempt"] += 1
            cfg = configs[name]
            ref = task.options(max_retries=0, **options[name]).remote(
                cfg.to_dict(), force, record["attempt"], deadline_of(cfg)
            )
            pending[ref] = name
            record.update(status="running", resources=describe_resources(options[name]))
            record.setdefault("started_at", time.time())
            for key in ("error", "traceback", "note"):
                record.pop(key, None)
            log.info("matrix %s: job %s submitted to Ray (%s, attempt %d)", preset_name, name,
                     describe_resources(options[name]), record["attempt"])  # fmt: skip

        for name, cfg in jobs:
            record = results.setdefault(name, {})
            record.update(run_dir=str(cfg.execution.run_dir), model=cfg.models.model)
            record["arm"] = cfg.protocol.agent
            if job_status(Path(str(cfg.execution.run_dir))) == "complete":
                record["status"] = "complete"
                continue
            # attempts are numbered across resumes of the matrix
            placed = [a.get("attempt", 0) for a in read_placement(Path(record["run_dir"]))]
            record["attempt"] = max([record.get("attempt", 0), *placed])
            submit(name)
        save()
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    name = pending.pop(ref)
                    _finish(ray, ref, name, results[name], configs[name], submit, lost)
                save()
        except BaseException:
            for ref, name in pending.items():
                ray.cancel(ref)  # KeyboardInterrupt in the task: a served job stops its server
                results[name].update(status="interrupted", finished_at=time.time())
            save()
            raise


def _finish(
    ray: Any,
    ref: Any,
    name: str,
    record: dict[str, Any],
    cfg: RunConfig,
    submit: Callable[[str], None],
    lost_before: dict[str, int],
) -> None:
    """Record one attempt's end; submit the job again when its node or worker died (at most
    ``job_retries`` times in this session)."""
    job_dir = Path(str(cfg.execution.run_dir))
    attempt = record["attempt"]
    try:
        fields = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # a bug around the job (its own errors are caught)
        fields = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:2000],
            "traceback": traceback.format_exc()[-8000:],
            "finished_at": time.time(),
        }
    except ray.exceptions.RayError as exc:  # the node or the worker died
        lost = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        _merge_attempts(record, job_dir, {attempt: lost})
        lost_before[name] = lost_before.get(name, 0) + 1
        if lost_before[name] <= cfg.cluster.job_retries:
            log.warning("job %s lost its Ray worker (%s): submitting it again", name, lost)
            submit(name)
            return
        record.update(status="failed", error=f"lost {lost_before[name]} times; last: {lost}")
        record["finished_at"] = time.time()
        return
    node = fields.pop("node", None)
    record.update(fields)
    if node is not None:
        record["node"] = {k: node[k] for k in ("node_id", "node_ip", "host")}
    _merge_attempts(record, job_dir, {})
    if record.get("status") == "failed":
        log.warning("job %s failed: %s", name, record.get("error"))


def _merge_attempts(record: dict[str, Any], job_dir: Path, lost: dict[int, str]) -> None:
    """``record['attempts']``: where each attempt ran (its placement) and how it ended."""
    known = {a["attempt"]: dict(a) for a in record.get("attempts", [])}
    for placed in read_placement(job_dir):
        known.setdefault(placed["attempt"], {}).update(placed)
    for attempt, reason in lost.items():
        known.setdefault(attempt, {"attempt": attempt})["lost"] = reason
    record["attempts"] = [known[k] for k in sorted(known)]


# -- served replicas ----------------------------------------------------------------------------
class ReplicaActor:
    """A Ray actor that runs one supervised model server on its node, on the node's address."""

    def __init__(self) -> None:
        self.server: Any = None

    def start(self, values: dict[str, Any], index: int, run_dir: str) -> dict[str, Any]:
        import ray

        from experiments.serve import ModelServer, free_port, port_free, serve_settings

        cfg = from_mapping(values, source="served replica")
        host = ray.util.get_node_ip_address()
        port = cfg.server.serve_port + index  # replicas may share a node
        if not port_free(host, port):
            port = free_port(host)
        logs = Path(run_dir)
        settings = serve_settings(
            cfg.replace(serve_port=port, base_url=None),
            logs / f"server-{index}.log",
            logs / f"server-{index}.pid",
            host=host,
        )
        self.server = ModelServer(settings).start()
        return {
            "url": settings.url,
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "log": str(settings.log_path),
        }

    def stop(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        self.server.stop()
        return {"restarts": self.server.restarts, "failed": self.server.failed}


def _repoint(run_dir: Path, base_url: str) -> None:
    """A resumed run's replicas listen elsewhere now: its manifest gets their URLs (an event
    records the move; which server answers never changes a result)."""
    from experiments.store import RunStore

    if not (run_dir / "run.sqlite").is_file():
        return
    store = RunStore(run_dir)
    try:
        manifest = store.get_meta("manifest") or {}
        old = manifest.get("config", {}).get("base_url")
        if manifest and old != base_url:
            manifest["config"]["base_url"] = base_url
            store.set_meta("manifest", manifest)
            store.log_event("serve_replicas", json.dumps({"from": old, "to": base_url}))
    finally:
        store.close()


def run_on_replicas(
    cfg: RunConfig, run_dir: Path, resume: str | None, force: bool, progress: Any = None
) -> Path:
    """``runner.run`` against ``serve_replicas`` model servers started as Ray actors (each
    reserving the model's GPUs, spread over the nodes); stops them at the end."""
    from experiments.runner import run
    from experiments.serve import ServeError, served_config
    from experiments.store import RunStore

    with session(str(cfg.cluster.address)) as ray:
        options = {"num_cpus": 1, **_gpu_options(cfg, model_gpus(cfg))}
        check_fits("serve replica", options, _alive_nodes(ray))
        replica = ray.remote(ReplicaActor).options(
            max_restarts=0, scheduling_strategy="SPREAD", **options
        )
        actors = [replica.remote() for _ in range(cfg.cluster.serve_replicas)]
        infos: list[dict[str, Any]] = []
        try:
            starts = [a.start.remote(cfg.to_dict(), i, str(run_dir)) for i, a in enumerate(actors)]
            try:
                infos = ray.get(starts)
            except ray.exceptions.RayTaskError as exc:
                raise ServeError(f"a served replica did not start: {exc.cause}") from None
            urls = ",".join(info["url"] for info in infos)
            log.info("serving %s on %s", cfg.models.model, urls)
            served = served_config(cfg.replace(run_dir=str(run_dir)), cfg.server.serve_port)
            if resume:
                _repoint(run_dir, urls)
            return run(served.replace(base_url=urls), resume=resume, force=force, progress=progress)
        finally:
            ends = _stop_replicas(ray, actors)
            if infos and (run_dir / "run.sqlite").is_file():
                store = RunStore(run_dir)
                try:
                    replicas = [{**i, **e} for i, e in zip(infos, ends, strict=True)]
                    store.set_meta("server", {"replicas": replicas})
                finally:
                    store.close()


def _stop_replicas(ray: Any, actors: list[Any]) -> list[dict[str, Any]]:
    """Stop each replica's server (SIGTERM, then SIGKILL), then the actors; how each ended."""
    stops = [a.stop.remote() for a in actors]
    ray.wait(stops, num_returns=len(stops), timeout=120.0)
    ends = []
    for ref, actor in zip(stops, actors, strict=True):
        try:
            ends.append(ray.get(ref, timeout=0))
        except Exception as exc:  # noqa: BLE001 - a replica that is gone has nothing to stop
            ends.append({"failed": f"{type(exc).__name__}"})
        ray.kill(actor, no_restart=True)
    return ends
