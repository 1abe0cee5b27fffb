"""Experiment presets and the job matrix: several runs, one after another (or on Ray), one report.

A preset is a YAML file in ``experiments/configs/`` (run it by name: ``--config paper``) or
anywhere (``--config path.yaml``). Either plain config keys (one run, as any ``--config`` file),
or a matrix::

    description: what it compares
    extends: paper            # optional: start from another preset's base and jobs
    needs_data: true          # optional: the real ALFWorld games ($ALFWORLD_DATA or --data)
    base: {<config keys shared by every job>}
    jobs:
      - {name: react, agent: react}
      - {name: reflexion, agent: reflexion}

A job's config is: defaults < ``base`` < the job's keys < the flags given on the command line
(so ``--model scripted:expert --games 2 --data DIR`` turns any preset into a quick CPU check; a
preset's ``serve: true`` is dropped for a job whose model, after the flags, is not ``vllm:``, and
its ``backend_options`` for a job whose ``--model`` is another kind of backend).
Each job runs in ``<run dir>/<job name>`` (default run dir ``runs/<preset>-<time>``), one after
another; a job that fails is recorded in ``<run dir>/matrix.json`` with its error and the matrix
goes on. Consecutive jobs that serve the same model with the same command share one server.
A relative ``deadline`` (``8h``) is for the whole matrix. At the end one combined report is
written to ``<run dir>/report``. ``--resume <run dir>`` plays every job that is not complete
(interrupted ones continue from their last step, via the runner's resume), with the preset and
flags recorded in ``matrix.json`` (flags given again override them); a job is complete under
the trials given now (a job that played all of 2 trials is not complete under ``--trials 3``).

With ``--ray ADDRESS`` (or ``--ray local``) the jobs run as Ray tasks instead, in parallel where
the cluster's resources allow, each reserving its model's GPUs and its env workers' CPUs; a job
whose node dies is submitted again and resumes from its run store; the directory must be on
storage every node sees. See :mod:`experiments.cluster`.

Dry runs (``--dry-run``) print each job's plan and need neither the models nor the games: when
the games are not there yet, the plan counts the games the run would play: "134 games of
eval_out_of_distribution (data not present)" for a ``needs_data`` preset, or the games a run
would generate on first use (which the dry run does not generate).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from agents import arms
from envs.discovery import SPLITS, TASK_TYPES, split_dir
from experiments.cluster import run_jobs, waiting_note
from experiments.config import (
    RunConfig,
    data_root,
    flatten,
    from_mapping,
    load_yaml,
    parse_deadline,
    public_values,
)
from experiments.errors import ConfigError, RunStoreError
from experiments.games import generated_games_dir, select_games, textworld_cache_dir
from experiments.lock import DirLock
from experiments.ray_session import describe_resources, import_ray, job_resources
from experiments.report import write_report
from experiments.serve import (
    HOST,
    ModelServer,
    check_serve,
    serve_settings,
    serve_template,
    served_model,
    server_argv,
    stop_server_on_signals,
)
from experiments.session import RunSession, record_notes, run_dir_of
from experiments.store import DB_NAME, RunState, RunStore
from memory.files import write_text

log = logging.getLogger("reflexsim.matrix")

STATE_FILE = "matrix.json"
LOCK_FILE = "matrix.lock"  # held by the one process that runs the matrix
PRESET_KEYS = {"description", "extends", "needs_data", "base", "jobs"}
# The sizes of ALFWorld's splits (protocol facts), for plans made without the games.
SPLIT_SIZES = {"eval_out_of_distribution": 134, "eval_in_distribution": 140, "train": 3553}
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Job:
    name: str
    overrides: Mapping[str, Any]


@dataclass(frozen=True)
class Preset:
    """A loaded preset. ``jobs`` is empty for a plain (one-run) preset."""

    name: str
    path: Path | None
    description: str
    base: Mapping[str, Any]
    jobs: tuple[Job, ...] = ()
    needs_data: bool = False

    @property
    def is_matrix(self) -> bool:
        return bool(self.jobs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path) if self.path else None,
            "description": self.description,
            "base": dict(self.base),
            "jobs": [{"name": j.name, **j.overrides} for j in self.jobs],
            "needs_data": self.needs_data,
        }


# -- presets -------------------------------------------------------------------------------------
def preset_dir() -> Path:
    return Path(str(resources.files("experiments.configs")))


def preset_names() -> list[str]:
    """The presets shipped with the package."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def find_preset(name_or_path: str) -> Path:
    """A preset file: an existing path, else a shipped preset's name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = preset_dir() / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if os.sep not in name_or_path and candidate.is_file():
        return candidate
    raise ConfigError(
        f"config {name_or_path!r} is neither a file nor a preset: presets are "
        f"{', '.join(preset_names())}"
    )


def load_preset(name_or_path: str, _seen: tuple[str, ...] = ()) -> Preset:
    """Load and check a preset (every job's config is validated here)."""
    path = find_preset(name_or_path)
    name = path.stem
    data = load_yaml(path)
    if not PRESET_KEYS & set(data):
        return Preset(name, path, "", data)  # plain config keys: one run
    unknown = sorted(set(data) - PRESET_KEYS)
    if unknown:
        raise ConfigError(
            f"preset {name}: unknown top-level key(s) {', '.join(map(repr, unknown))}: a matrix "
            f"has {', '.join(sorted(PRESET_KEYS))} (config keys go under base: or a job)"
        )
    base: dict[str, Any] = {}
    jobs: tuple[Job, ...] = ()
    needs_data = False
    description = ""
    if "extends" in data:
        parent_name = str(data["extends"])
        if parent_name in (*_seen, name):
            raise ConfigError(f"preset {name}: extends itself through {parent_name!r}")
        parent = load_preset(parent_name, (*_seen, name))
        base, jobs, needs_data = dict(parent.base), parent.jobs, parent.needs_data
        description = parent.description
    own_base = data.get("base") or {}
    if not isinstance(own_base, dict):
        raise ConfigError(f"preset {name}: base: must be a mapping of config keys")
    base.update(own_base)
    if "jobs" in data:
        jobs = _parse_jobs(name, data["jobs"])
    if not jobs:
        raise ConfigError(f"preset {name}: no jobs: add jobs: [{{name: ..., <keys>}}, ...]")
    needs_data = bool(data.get("needs_data", needs_data))
    description = str(data.get("description", description) or "")
    preset = Preset(name, path, description, base, jobs, needs_data)
    for job in jobs:
        job_config(preset, job, {}, Path("runs") / name)
    return preset


def preset_from_dict(data: Mapping[str, Any]) -> Preset:
    """The preset recorded in a matrix's state file."""
    jobs = _parse_jobs(str(data["name"]), data["jobs"])
    return Preset(
        name=str(data["name"]),
        path=Path(data["path"]) if data.get("path") else None,
        description=str(data.get("description") or ""),
        base=dict(data.get("base") or {}),
        jobs=jobs,
        needs_data=bool(data.get("needs_data")),
    )


def _parse_jobs(preset: str, raw: Any) -> tuple[Job, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"preset {preset}: jobs: must be a list of mappings with a name")
    jobs: list[Job] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"preset {preset}: job {i + 1} needs a name: (a mapping)")
        name = str(item["name"])
        if not _JOB_NAME.match(name):
            raise ConfigError(
                f"preset {preset}: job name {name!r} must be letters, digits and . _ + - "
                "(it names the job's run directory)"
            )
        if name in {j.name for j in jobs}:
            raise ConfigError(f"preset {preset}: two jobs are named {name!r}")
        jobs.append(Job(name, {k: v for k, v in item.items() if k != "name"}))
    return tuple(jobs)


def job_config(
    preset: Preset, job: Job, flags: Mapping[str, Any], run_dir: Path, start: float | None = None
) -> RunConfig:
    """A job's resolved config: defaults < base < job < flags; its run dir under ``run_dir``."""
    where = f"preset {preset.name}, job {job.name}"
    values: dict[str, Any] = {**flatten(preset.base, where), **flatten(job.overrides, where)}
    if "model" in flags and "backend_options" not in flags:
        if _backend_kind(flags["model"]) != _backend_kind(values.get("model")):
            values.pop("backend_options", None)  # e.g. llama.cpp threads, for a scripted model
    values.update({k: v for k, v in flags.items() if k != "run_dir"})
    values["run_dir"] = str(run_dir / job.name)
    source = source_job(preset, values)
    if source is not None:  # an earlier job's run
        values["experience_from"] = str(run_dir / source)
    if values.get("serve") and "serve" not in flags and not _is_vllm(values.get("model")):
        values["serve"] = False  # e.g. --model scripted:expert on a served preset
    cfg = from_mapping(values, source=where)
    if cfg.server.serve:
        check_serve(cfg)
    if start is not None and cfg.budget.deadline is not None:
        # one deadline for the whole matrix, not a fresh "8h" per job
        when = parse_deadline(cfg.budget.deadline, start)
        assert when is not None
        cfg = cfg.replace(deadline=datetime.fromtimestamp(when).isoformat(timespec="seconds"))
    return cfg


def source_job(preset: Preset, values: Mapping[str, Any]) -> str | None:
    """The preset's job whose run a job's resolved ``values`` read (``experience_from`` naming
    it), or None."""
    source = values.get("experience_from")
    return str(source) if source in {j.name for j in preset.jobs} else None


def job_sources(preset: Preset, flags: Mapping[str, Any]) -> dict[str, str]:
    """Each job that reads another job's run -> that job; a ConfigError when the source does not
    come before it (the jobs play in the preset's order, and on Ray a job waits for its
    source)."""
    where = f"preset {preset.name}"
    order = [j.name for j in preset.jobs]
    out: dict[str, str] = {}
    for job in preset.jobs:
        values = {**flatten(preset.base, where), **flatten(job.overrides, where), **flags}
        source = source_job(preset, values)
        if source is None:
            continue
        if order.index(source) >= order.index(job.name):
            raise ConfigError(
                f"{where}: job {job.name} reads the run of job {source}, which does not come "
                f"before it: list {source} first"
            )
        out[job.name] = source
    return out


def _backend_kind(model: Any) -> str:
    return str(model or "").strip().lower().split(":", 1)[0]


def _is_vllm(model: Any) -> bool:
    return _backend_kind(model) == "vllm"


def default_matrix_dir(preset: Preset) -> Path:
    return Path("runs") / f"{preset.name}-{time.strftime('%Y%m%d-%H%M%S')}"


# -- plans ---------------------------------------------------------------------------------------
def plan_job(cfg: RunConfig, needs_data: bool = False) -> dict[str, Any]:
    """:func:`dry_run_plan` when the games are there; otherwise a plan that says what is
    missing."""
    missing = _games_not_present(cfg, needs_data)
    if missing is None:
        out = dry_run_plan(cfg)
    else:
        n, note = missing
        out = estimated_plan(cfg, n)
        out["games_note"] = note
    if cfg.server.serve:
        words = server_argv(serve_template(cfg), served_model(cfg), HOST, cfg.server.serve_port)
        out["serve"] = {
            "command": shlex.join(words),
            "url": f"http://{HOST}:{cfg.server.serve_port}/v1",
            "log": str(Path(cfg.execution.run_dir or ".") / "server.log"),
        }
    if cfg.cluster.address:
        out["ray"] = {
            "address": cfg.cluster.address,
            "reserves": describe_resources(job_resources(cfg)),
        }
    return out


def dry_run_plan(cfg: RunConfig) -> dict[str, Any]:
    """What a run would do, without running it (``--dry-run``)."""
    games = select_games(cfg)
    by_type: dict[str, int] = {}
    for t in games.tasks:
        by_type[t.task_type] = by_type.get(t.task_type, 0) + 1
    return estimated_plan(
        cfg,
        len(games.tasks),
        env=games.env_kind,
        games_by_type=by_type,
        first_games=[t.game for t in games.tasks[:5]],
    )


def estimated_plan(cfg: RunConfig, n: int, **games: Any) -> dict[str, Any]:
    """The plan of a run over ``n`` games (``games``: what is known about them)."""
    reflects = arms.get(cfg.protocol.agent).memory.reflects
    reflections = n * (cfg.protocol.trials - 1) if reflects else 0
    return {
        "model": cfg.models.model,
        "reflect_model": cfg.models.reflector,
        "arm": cfg.protocol.agent,
        "evaluator": cfg.evaluation.evaluator,
        "env": cfg.gameset.env,
        "games": n,
        **games,
        "trials": cfg.protocol.trials,
        "max_steps": cfg.protocol.max_steps,
        "memory_size": cfg.protocol.memory_size,
        "estimated_requests": {
            "actor_steps_at_most": n * cfg.protocol.trials * cfg.protocol.max_steps,
            "reflections_at_most": reflections,
            "judge_calls_at_most": n * cfg.protocol.trials
            if cfg.evaluation.evaluator == "llm"
            else 0,
        },
        "config": cfg.to_dict(public=True),
    }


def _games_not_present(cfg: RunConfig, needs_data: bool) -> tuple[int, str] | None:
    """(games, note) when a plan cannot list the games without making or finding them."""

    if cfg.gameset.env == "textworld":
        if cfg.gameset.data is not None or (textworld_cache_dir(cfg) / ".complete").is_file():
            return None
        n = len(cfg.gameset.game_ids) or max(cfg.gameset.games or 3, 1)
        return (
            n,
            f"{n} TextWorld games generated on first run (seed {cfg.protocol.seed}; not made yet)",
        )
    root_dir = data_root(cfg)
    games_dir = split_dir(Path(root_dir), cfg.gameset.split) if root_dir else None
    if games_dir is not None and games_dir.is_dir():
        return None
    if root_dir or needs_data:
        total = SPLIT_SIZES.get(cfg.gameset.split)
        n = len(cfg.gameset.game_ids) or min(
            cfg.gameset.games or total or 0, total or cfg.gameset.games or 0
        )
        where = (
            f"{games_dir} is missing"
            if games_dir is not None
            else "data not present: set $ALFWORLD_DATA or pass --data DIR"
        )
        return n, f"{n} games of {cfg.gameset.split} ({where})"
    root = generated_games_dir(cfg)
    if (root / SPLITS.get(cfg.gameset.split, cfg.gameset.split) / ".complete").is_file():
        return None
    made = len(set(TASK_TYPES.values())) * cfg.gameset.generate_per_type
    if cfg.gameset.task_types:
        made = len(cfg.gameset.task_types) * cfg.gameset.generate_per_type
    n = len(cfg.gameset.game_ids) or min(cfg.gameset.games or made, made)
    return n, (
        f"{n} of the {made} games of {cfg.gameset.split} generated on first run "
        f"({cfg.gameset.generate_per_type} per task type, seed {cfg.protocol.seed}) into {root}"
    )


def plan_matrix(
    preset: Preset, flags: Mapping[str, Any], run_dir: Path | None = None
) -> dict[str, Any]:
    """The dry run of a matrix: each job's plan, and the totals."""
    root = run_dir or default_matrix_dir(preset)
    jobs = []
    sources = job_sources(preset, flags)
    for job in preset.jobs:
        cfg = job_config(preset, job, flags, root)
        after = {"after": sources[job.name]} if job.name in sources else {}
        jobs.append({"job": job.name, **after, **plan_job(cfg, preset.needs_data)})
    total = sum(sum(j["estimated_requests"].values()) for j in jobs)
    return {
        "preset": preset.name,
        "description": preset.description,
        "run_dir": str(root),
        "jobs": jobs,
        "arms": sorted({j["arm"] for j in jobs}),
        "models": sorted({j["model"] for j in jobs}),
        "estimated_requests_at_most": total,
    }


# -- running -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatrixResult:
    run_dir: Path
    jobs: dict[str, dict[str, Any]]  # job name -> status record (as in matrix.json)
    report: Path | None

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.jobs.items() if r.get("status") == "failed"]

    @property
    def with_errors(self) -> list[str]:
        """Jobs that ended with tasks left by infrastructure errors (--resume retries them)."""
        return [n for n, r in self.jobs.items() if r.get("status") == "errors"]


def is_matrix_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def read_state(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RunStoreError(f"cannot read {run_dir / STATE_FILE}: {exc}") from None
    if not isinstance(data, dict) or "preset" not in data:
        raise RunStoreError(f"{run_dir / STATE_FILE} is not a matrix state file")
    return data


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    write_text(
        run_dir / STATE_FILE, json.dumps(state, indent=1, sort_keys=True, default=str) + "\n"
    )


def job_status(job_dir: Path, trials: int | None = None) -> str:
    """``new`` (no run yet), else the status its run store derives (a ``RunStatus`` value:
    ``complete``, ``running``, ``stopped``, ``interrupted`` or ``errors``); ``trials``: under
    that many trials (a resume may give more: a job complete with fewer is not)."""
    return job_state(job_dir, trials)[0]


def job_state(job_dir: Path, trials: int | None = None) -> tuple[str, RunState | None]:
    """``job_status`` and the run state behind it (None for a new job)."""

    if not (job_dir / DB_NAME).is_file():
        return "new", None
    store = RunStore(job_dir, readonly=True)
    try:
        state = store.run_state(trials)
    finally:
        store.close()
    return state.status.value, state


class _Servers:
    """At most one model server at a time, shared by consecutive jobs that serve the same."""

    def __init__(self, matrix_dir: Path) -> None:
        self.matrix_dir = matrix_dir
        self.key: tuple[Any, ...] | None = None
        self.server: Any = None

    def get(self, cfg: RunConfig, job_dir: Path) -> Any:
        settings = serve_settings(cfg, job_dir / "server.log", self.matrix_dir / "server.pid")
        key = (settings.argv, settings.port, settings.model, settings.startup_timeout_s)
        if self.server is not None and key == self.key and self.server.failed is None:
            return self.server
        self.close()
        job_dir.mkdir(parents=True, exist_ok=True)
        self.server = ModelServer(settings).start()
        self.key = key
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
            self.key = None


def run_matrix(
    preset: Preset | None,
    flags: Mapping[str, Any],
    run_dir: Path | None = None,
    resume: bool = False,
    force: bool = False,
) -> MatrixResult:
    """Run every job of a matrix; with ``resume``, the unfinished jobs of the one in ``run_dir``.

    A resumed matrix uses the preset and flags recorded in its state file (``preset`` is
    ignored); flags given now override the recorded ones.
    """
    if resume:
        if run_dir is None or not is_matrix_dir(run_dir):
            raise RunStoreError(f"{str(run_dir)!r} holds no matrix ({STATE_FILE} is missing)")
        root = Path(run_dir)
        lock = DirLock(root, LOCK_FILE).acquire(what="a preset run")
        try:
            state = read_state(root)
            preset = preset_from_dict(state["preset"])
        except BaseException:
            lock.release()
            raise
        flags = {**state.get("flags", {}), **flags}
        state["resumed_at"] = time.time()
    else:
        if preset is None:
            raise ConfigError("no preset given: pass --config <preset or file>")
        root = Path(run_dir) if run_dir is not None else default_matrix_dir(preset)
        lock = DirLock(root, LOCK_FILE)
        lock.refuse_if_held("a preset run")
        if is_matrix_dir(root):
            raise RunStoreError(
                f"{str(root)!r} already holds a matrix: use --resume {root} or another --run-dir"
            )
        if root.exists() and any(p.name != LOCK_FILE for p in root.iterdir()):
            raise RunStoreError(
                f"{str(root)!r} is not empty and holds no matrix: pick another --run-dir"
            )
        state = {
            "preset": public_values(preset.to_dict()),
            "flags": dict(flags),
            "started_at": time.time(),
            "jobs": {},
        }
    try:
        return _run_matrix(preset, flags, root, state, lock, force)
    finally:
        lock.release()


def _run_matrix(
    preset: Preset,
    flags: Mapping[str, Any],
    root: Path,
    state: dict[str, Any],
    lock: DirLock,
    force: bool,
) -> MatrixResult:
    on_ray = _ray_address(preset, flags)
    if on_ray:
        import_ray()  # a missing extra is a one-line error before anything is written
        root = root.resolve()  # every node must find it at the same path
    state["flags"] = public_values({k: v for k, v in dict(flags).items() if k != "run_dir"})
    start = time.time()
    configs = [(job, job_config(preset, job, flags, root, start)) for job in preset.jobs]
    sources = job_sources(preset, flags)
    if preset.needs_data:
        if not all(data_root(cfg) or cfg.gameset.env != "alfworld" for _, cfg in configs):
            raise ConfigError(
                f"preset {preset.name} plays the real ALFWorld games of "
                f"{configs[0][1].gameset.split}: set $ALFWORLD_DATA or pass --data DIR "
                "(generated games: reflexsim games generate --out DIR ...)"
            )
    # every job's config checked first (a bad flag leaves no folder); the lock makes the folder
    # and comes before anything is written into it
    lock.acquire(what="a preset run")
    results: dict[str, dict[str, Any]] = state.setdefault("jobs", {})
    _write_state(root, state)

    play = functools.partial(play_job, force=force)
    with stop_server_on_signals():
        if on_ray:
            state["ray"] = on_ray
            todo = []
            for job, cfg in _own_ports(configs):
                if job_status(run_dir_of(cfg), cfg.protocol.trials) == "complete":
                    results.setdefault(job.name, {})["status"] = "complete"
                else:
                    todo.append((job.name, cfg))
            run_jobs(
                preset.name,
                todo,
                root,
                results,
                lambda: _write_state(root, state),
                lambda cfg: parse_deadline(cfg.budget.deadline, start),
                play,
                sources,
            )
        else:
            _run_jobs(preset, configs, root, state, results, _Servers(root), start, play, sources)
    report = _report(root, preset, results, state)
    return MatrixResult(root, results, report)


def play_job(
    cfg: RunConfig,
    notes: Mapping[str, Any] | None = None,
    *,
    force: bool = False,
    servers: _Servers | None = None,
) -> dict[str, Any]:
    """Play one job to its end, resuming it if it was started (``notes``: meta its store
    records; ``servers``: share a server with the previous job). Returns the fields of its
    record; its own errors are recorded, not raised (KeyboardInterrupt is)."""
    session = RunSession.job(cfg, force)
    job_dir = session.run_dir
    out: dict[str, Any] = {"started_at": time.time()}
    # e.g. a lost attempt that had finished it (under the trials it is given now)
    if job_status(job_dir, cfg.protocol.trials) == "complete":
        record_notes(job_dir, dict(notes or {}))
        return {"status": "complete"}
    session.notes.update(notes or {})
    try:
        if cfg.server.serve:
            session.check()  # bad games fail before a long server start
            server = servers.get(cfg, job_dir) if servers is not None else None
            out["server_log"] = str(server.settings.log_path if server else job_dir / "server.log")
            session.server = server
        elif servers is not None:
            servers.close()
        session.run()
    except Exception as exc:  # noqa: BLE001 - recorded; the next job still runs
        out.update(
            status="failed",
            error=f"{type(exc).__name__}: {exc}".splitlines()[0][:2000],
            traceback=traceback.format_exc()[-8000:],
            finished_at=time.time(),
        )
        return out
    status, state = job_state(job_dir, cfg.protocol.trials)
    out["status"] = status
    if state is not None and state.status.value == "errors":
        out["error"] = errors_note(state)
    elif state is not None and state.stopped:
        out["note"] = state.stopped
    out["finished_at"] = time.time()
    out["wall_s"] = round(out["finished_at"] - out["started_at"], 2)
    return out


def errors_note(state: RunState) -> str:
    """What a run that ended with infrastructure errors left, and what plays it."""
    left = state.tasks - state.finished
    return (
        f"{left} of {state.tasks} tasks left by infrastructure errors "
        f"({state.errors} episodes): --resume retries them"
    )


def _run_jobs(
    preset: Preset,
    configs: list[tuple[Job, RunConfig]],
    root: Path,
    state: dict[str, Any],
    results: dict[str, dict[str, Any]],
    servers: _Servers,
    start: float,
    play: Callable[..., dict[str, Any]],
    sources: Mapping[str, str],
) -> None:
    """Play the jobs one after another (``play``: :func:`play_job`, its ``force`` given); a job
    whose source job (``sources``) did not complete is left pending."""
    try:
        for job, cfg in configs:
            job_dir = run_dir_of(cfg)
            record = results.setdefault(job.name, {})
            record.update(run_dir=str(job_dir), model=cfg.models.model, arm=cfg.protocol.agent)
            status = job_status(job_dir, cfg.protocol.trials)
            if status == "complete":
                record["status"] = "complete"
                continue
            deadline = parse_deadline(cfg.budget.deadline, start)
            if deadline is not None and time.time() >= deadline:
                record.update(status="pending", note="deadline reached before it started")
                continue
            if job.name in sources and results[sources[job.name]].get("status") != "complete":
                record.update(status="pending", note=waiting_note(sources[job.name], results))
                _say(f"matrix {preset.name}: job {job.name} {record['note']}")
                continue
            record.update(status="running", started_at=time.time())
            record.pop("error", None)
            record.pop("traceback", None)
            _write_state(root, state)
            _say(f"matrix {preset.name}: job {job.name} ({cfg.models.model}, {cfg.protocol.agent})")
            try:
                record.update(play(cfg, servers=servers))
            except KeyboardInterrupt:
                record.update(status="interrupted", finished_at=time.time())
                raise
            finally:
                _write_state(root, state)
            if record["status"] == "failed":
                _say(f"matrix {preset.name}: job {job.name} failed: {record['error']}")
    finally:
        servers.close()
        _write_state(root, state)


def _ray_address(preset: Preset, flags: Mapping[str, Any]) -> str | None:
    """The Ray cluster the matrix runs on (``--ray``, or the preset's ``ray:``), or None."""
    ray = flags.get("ray", flatten(preset.base, f"preset {preset.name}").get("ray"))
    return from_mapping({"ray": ray}, f"preset {preset.name}").cluster.address


def _own_ports(configs: list[tuple[Job, RunConfig]]) -> list[tuple[Job, RunConfig]]:
    """On Ray, served jobs may share a node: each serves on its own port (the preset's port
    plus the job's index), the same one on every attempt."""
    out = []
    for index, (job, cfg) in enumerate(configs):
        if cfg.server.serve and cfg.cluster.serve_replicas == 1:
            cfg = cfg.replace(serve_port=cfg.server.serve_port + index)
        out.append((job, cfg))
    return out


def _report(
    root: Path, preset: Preset, results: dict[str, dict[str, Any]], state: dict[str, Any]
) -> Path | None:

    dirs = [
        Path(results[j.name]["run_dir"])
        for j in preset.jobs
        if j.name in results and (Path(results[j.name]["run_dir"]) / "run.sqlite").is_file()
    ]
    state.pop("report_error", None)
    if not dirs:
        state["report"] = None
        _write_state(root, state)
        return None
    try:
        out = write_report(dirs, root / "report")
    except Exception as exc:  # noqa: BLE001 - the runs are safe; say why the report is missing
        state["report"] = None
        state["report_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        _write_state(root, state)
        return None
    state["report"] = str(out)
    state["finished_at"] = time.time()
    _write_state(root, state)
    return out


def _say(text: str) -> None:
    log.info(text)
