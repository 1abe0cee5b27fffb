"""A preset's jobs as Ray tasks (``--ray``; the connection and resources: :mod:`ray_session`).

Every job that is not complete is submitted at once as a task that reserves its resources
(:func:`experiments.ray_session.job_resources`: its model's GPUs, CPUs for its env workers);
Ray runs them in parallel where the resources allow. A job writes its run directory under the
matrix's directory, which must be storage every node sees at the same path: checked at start
(:func:`check_shared_storage`). A task whose node or worker dies is submitted again, up to
``job_retries`` times; the new attempt resumes the job from its run store (the runner's
``--resume``), after taking the job's lock, which the dead attempt's process held until it was
gone. Each attempt records where it ran in ``<job>/placement.json``, in the run store
(``placement``) and in ``matrix.json``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments.config import RunConfig, from_mapping
from experiments.errors import ConfigError
from experiments.lock import DirLock
from experiments.ray_session import (
    alive_nodes,
    check_fits,
    describe_resources,
    job_resources,
    session,
)
from experiments.session import run_dir_of
from memory.files import write_text

log = logging.getLogger("reflexsim.cluster")

PLACEMENT_FILE = "placement.json"
LOCK_FILE = ".job.lock"
LOCK_WAIT_S = 600.0  # how long a new attempt waits for the lock of a job's previous attempt
PROBE_TIMEOUT_S = 180.0
# plays one job: (config, the meta its run store records) -> the fields of its record
Play = Callable[[RunConfig, Mapping[str, Any]], dict[str, Any]]


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
    # lazily: ray is an optional extra
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    marker = root / f".storage-{token}"
    marker.write_text(token)
    probe = ray.remote(_probe_storage)
    try:
        nodes = alive_nodes(ray)
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
    lock = DirLock(job_dir, LOCK_FILE).acquire(wait_s, what=f"an attempt of job {job_dir.name}")
    try:
        yield
    finally:
        lock.release()


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
    write_text(job_dir / PLACEMENT_FILE, json.dumps(attempts, indent=1) + "\n")


def _job_task(
    play: Play, values: dict[str, Any], attempt: int, deadline: float | None
) -> dict[str, Any]:
    """A job's Ray task: take its lock, record where it runs, ``play`` (or resume) it; its run
    store records the placement too."""
    import ray  # lazily: ray is an optional extra

    cfg = from_mapping(values, source="ray job")
    job_dir = run_dir_of(cfg)
    where = _where(ray, attempt)
    with job_lock(job_dir):
        attempts = [a for a in read_placement(job_dir) if a.get("attempt") != attempt]
        placement = [*attempts, where]
        _write_placement(job_dir, placement)
        if deadline is not None and time.time() >= deadline:
            return {
                "status": "pending",
                "note": "deadline reached before it started",
                "node": where,
            }
        return {**play(cfg, {"placement": placement}), "node": where}


# -- the matrix on Ray --------------------------------------------------------------------------
def run_jobs(
    preset_name: str,
    jobs: list[tuple[str, RunConfig]],
    root: Path,
    results: dict[str, dict[str, Any]],
    save: Callable[[], None],
    deadline_of: Callable[[RunConfig], float | None],
    play: Play,
    sources: Mapping[str, str],
) -> None:
    """Play a matrix's unfinished jobs as Ray tasks (see the module docstring), each with
    ``play`` on its node; ``results`` gets each job's record (as in ``matrix.json``), ``save``
    writes them. A job that reads another job's run (``sources``) is submitted once that job
    completes, and left pending when it ends otherwise."""
    address = str(jobs[0][1].cluster.address)
    with session(address) as ray:
        check_shared_storage(root, ray)
        nodes = alive_nodes(ray)
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
                play, cfg.to_dict(), record["attempt"], deadline_of(cfg)
            )
            pending[ref] = name
            record.update(status="running", resources=describe_resources(options[name]))
            record.setdefault("started_at", time.time())
            for key in ("error", "traceback", "note"):
                record.pop(key, None)
            log.info("matrix %s: job %s submitted to Ray (%s, attempt %d)", preset_name, name,
                     describe_resources(options[name]), record["attempt"])  # fmt: skip

        held = set()  # jobs waiting for their source job to complete
        for name, cfg in jobs:
            record = results.setdefault(name, {})
            record.update(run_dir=str(cfg.execution.run_dir), model=cfg.models.model)
            record["arm"] = cfg.protocol.agent
            # attempts are numbered across resumes of the matrix
            placed = [a.get("attempt", 0) for a in read_placement(Path(record["run_dir"]))]
            record["attempt"] = max([record.get("attempt", 0), *placed])
            if name in sources and sources[name] in configs:
                held.add(name)
                record.update(status="pending", note=f"waits for job {sources[name]}")
            elif name in sources and results[sources[name]].get("status") != "complete":
                record.update(status="pending", note=waiting_note(sources[name], results))
            else:
                submit(name)
        save()
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    name = pending.pop(ref)
                    _finish(ray, ref, name, results[name], configs[name], submit, lost)
                _release(held, sources, results, set(pending.values()), submit)
                save()
        except BaseException:
            for ref, name in pending.items():
                ray.cancel(ref)  # KeyboardInterrupt in the task: a served job stops its server
                results[name].update(status="interrupted", finished_at=time.time())
            save()
            raise


def waiting_note(source: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """Why a job that reads the run of job ``source`` was not started."""
    status = results.get(source, {}).get("status") or "not played"
    return f"not started: job {source}, whose run it reads, is {status}"


def _release(
    held: set[str],
    sources: Mapping[str, str],
    results: dict[str, dict[str, Any]],
    running: set[str],
    submit: Callable[[str], None],
) -> None:
    """Submit the held jobs whose source job completed; leave pending those whose source ended
    otherwise (and, in turn, the jobs that wait for them)."""
    changed = True
    while changed:
        changed = False
        for name in sorted(held):
            source = sources[name]
            if source in running or source in held:
                continue
            held.discard(name)
            changed = True
            if results[source].get("status") == "complete":
                submit(name)
                running.add(name)
            else:
                results[name]["note"] = waiting_note(source, results)


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
    job_dir = run_dir_of(cfg)
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
