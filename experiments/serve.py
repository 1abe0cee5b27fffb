"""Serve a ``vllm:`` model for a run: start the server, wait until healthy, supervise, stop.

``--serve`` (or ``serve: true``) runs ``serve_command`` (default
:data:`agents.llm.vllm_backend.SERVE_COMMAND`; placeholders ``{model}``, ``{host}``, ``{port}``,
``{python}``) as a subprocess in its own process group, with stdout and stderr appended to
``<run dir>/server.log`` (through the redaction pass: :mod:`experiments.logpipe`) and its pid in
``<run dir>/server.pid``. It waits until ``GET /health``
answers (200; a 404 means the server has no such route, as llama.cpp's) and ``GET /v1/models``
lists the model, then points
the run at ``http://127.0.0.1:<port>/v1``: the ``vllm:`` spec with a ``base_url`` is the OpenAI
backend on the ``/completions`` endpoint (the prompt is sent exactly as rendered).

A supervisor thread polls the process (and ``/health`` every ``health_every_s``); when it exits,
or fails ``unhealthy_after`` health checks in a row, the whole process group is killed (vLLM's
engine runs in child processes) and the command is started again on the same port, up to
``max_restarts`` times. Requests in flight meanwhile fail and are retried by the OpenAI backend:
served runs default to a retry window of about ten minutes (:data:`RESTART_RETRIES` retries,
backoff capped at :data:`RESTART_BACKOFF_MAX_S`; ``backend_options`` override it), which covers a
restart; anything worse (a run that gives up, or a killed runner) is covered by the runner's
step-level ``--resume``. At the end the group gets SIGTERM, then SIGKILL after ``stop_grace_s``.

Two vLLM flags belong in every server command (the default and the presets have them):
``--generation-config vllm``, so that the server's sampling defaults are vLLM's own, as in
process (vLLM's default, ``auto``, takes repetition_penalty, top_k, ... from the model's
``generation_config.json`` for every field a request leaves out; both modes still take the EOS
ids from that file), and ``--enable-prompt-tokens-details``, without which the server reports
no cached prompt tokens. The manifest records what the server was told
(:func:`agents.llm.vllm_backend.engine_record`).

Several GPUs of one node: ``serve_data_parallel`` N (``--serve-data-parallel N``) adds vLLM's
own ``--data-parallel-size N`` to the command: N engines behind the one URL. The run sends every
request with an ``X-data-parallel-rank`` header derived from its game (the OpenAI backend's
``data_parallel_size``), so that all the steps of an episode, and the later trials of its game,
go to the engine whose prefix cache holds them. Several nodes: with ``--ray``, ``serve_replicas``
N starts N servers as Ray actors (:func:`serve_replicas`), each listening on its node's address,
and the run shards its games across their URLs as with a ``--base-url`` list.

The port is fixed (``serve_port``, default 8000) so that a resumed run finds its server at the
URL its manifest records. A server left behind by a killed runner is recognised by its pid file
(the same process: pid and start time; a console script such as ``vllm`` runs under its ``#!``
interpreter, so its command line is not the one recorded). If it was started with the same
command and environment and answers now, it is reused (a resumed run does not wait for the
model to load again); otherwise it is stopped before the new one starts. Any other program on
the port is an error naming the fix.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.llm.base import MissingDependencyError
from agents.llm.redaction import redact
from agents.llm.specs import parse_spec
from agents.llm.vllm_backend import SERVE_COMMAND
from experiments.config import RunConfig, from_mapping
from experiments.errors import ConfigError
from experiments.ray_session import alive_nodes, check_fits, gpu_options, model_gpus, session

log = logging.getLogger("reflexsim.serve")

HOST = "127.0.0.1"
# the server runs under experiments.logpipe (this very package, wherever the cwd is): its output
# reaches server.log through the redaction pass (vLLM prints its --api-key among its arguments)
LOG_PIPE = (
    sys.executable,
    "-c",
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from experiments.logpipe import main; "
    "sys.exit(main(sys.argv[1:]))",
    str(Path(__file__).resolve().parent.parent),
)
PLACEHOLDERS = ("{model}", "{host}", "{port}", "{python}")
# 1+2+4+8+16 s, then 30 s each: about 10 minutes before a request gives up
RESTART_RETRIES = 24
RESTART_BACKOFF_MAX_S = 30.0


class ServeError(ConfigError):
    """The model server could not be started or kept running; the message names its ``log``
    (where it is now: a refused run moves it out of the run directory)."""

    def __init__(self, reason: str, log: Path | None = None) -> None:
        super().__init__(reason)
        self.reason, self.log = reason, log

    def __str__(self) -> str:
        return self.reason if self.log is None else f"{self.reason}; see {self.log}"


@dataclass(frozen=True)
class ServeSettings:
    """How to run and watch one model server."""

    argv: tuple[str, ...]
    model: str  # the name the server must list in /v1/models
    port: int
    log_path: Path
    pid_path: Path
    host: str = HOST
    startup_timeout_s: float = 1800.0
    stop_grace_s: float = 30.0
    poll_s: float = 0.25
    health_every_s: float = 10.0
    unhealthy_after: int = 6
    max_restarts: int = 5
    env: dict[str, str] = field(default_factory=dict)

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-style base URL."""
        return f"{self.root_url}/v1"


def served_model(cfg: RunConfig) -> str:
    """The model a served run's server must serve (the target of its ``vllm:`` spec)."""

    spec = parse_spec(cfg.models.model)
    if spec.kind != "vllm":
        raise ConfigError(
            f"--serve starts a server for a vllm: model, not {cfg.models.model!r}: "
            "use --model vllm:<model>, or drop --serve"
        )
    return spec.target


def check_serve(cfg: RunConfig) -> None:
    """One-line errors for a served config that cannot work (before anything is started)."""
    served_model(cfg)
    if cfg.models.reflect_model and cfg.models.reflect_model != cfg.models.model:
        if parse_spec(cfg.models.reflect_model).kind == "vllm":
            raise ConfigError(
                f"--serve serves one model ({cfg.models.model}); reflect-model {cfg.models.reflect_model!r} "
                "must be the same model or an API model"
            )
    if not 1 <= cfg.server.serve_port <= 65535:
        raise ConfigError(f"serve-port must be in 1..65535, got {cfg.server.serve_port}")
    if cfg.server.serve_timeout_s <= 0:
        raise ConfigError(f"serve-timeout-s must be > 0, got {cfg.server.serve_timeout_s}")
    expected = f"http://{HOST}:{cfg.server.serve_port}/v1"
    if cfg.models.base_url and cfg.models.base_url.rstrip("/") != expected:
        raise ConfigError(
            f"--serve points the run at its own server ({expected}): drop --base-url "
            f"{redact(cfg.models.base_url)!r}, or drop --serve to use that server"
        )
    template = serve_template(cfg)
    if "{port}" not in template:
        raise ConfigError(
            f"serve-command {redact(template)!r} must pass the port as {{port}} "
            "(e.g. --port {port})"
        )
    server_argv(template, served_model(cfg), HOST, cfg.server.serve_port)


def serve_template(cfg: RunConfig) -> str:
    """The server command template of a config: ``serve_command`` (or the default), with
    ``--data-parallel-size N`` added for ``serve_data_parallel`` N > 1 (vLLM's own data
    parallelism: N engines, one per GPU of this node, behind one URL)."""
    template = cfg.server.serve_command or SERVE_COMMAND
    n = cfg.server.serve_data_parallel
    if n == 1:
        return template
    if any(w.split("=")[0] in ("--data-parallel-size", "-dp") for w in template.split()):
        raise ConfigError(
            f"serve-command already sets --data-parallel-size: drop --serve-data-parallel {n}, "
            "or drop it from the command"
        )
    return f"{template} --data-parallel-size {n}"


def server_argv(template: str, model: str, host: str, port: int) -> tuple[str, ...]:
    """The command line: the template split like a shell would, placeholders filled in.

    The program is left as written; :func:`serve_settings` finds it when a server is started.
    """
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ConfigError(f"serve-command {redact(template)!r} cannot be split: {exc}") from None
    if not words:
        raise ConfigError("serve-command is empty: give a command such as vllm serve {model} ...")
    values = {"{model}": model, "{host}": host, "{port}": str(port), "{python}": sys.executable}
    argv = []
    for word in words:
        for key, value in values.items():
            word = word.replace(key, value)
        argv.append(word)
    return tuple(argv)


def _executable(name: str) -> str:
    if os.sep in name:
        return name
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name  # a venv's bin/ when the venv is not activated
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    if name == "vllm":
        raise MissingDependencyError("vllm", "vllm")
    raise ConfigError(
        f"serve-command program {name!r} not found on PATH: install it or fix the path"
    )


def serve_settings(
    cfg: RunConfig, log_path: Path, pid_path: Path | None = None, host: str = HOST
) -> ServeSettings:
    """The server of a served config (checked with :func:`check_serve`), listening on ``host``
    (a replica on a cluster node listens on the node's address)."""
    check_serve(cfg)
    model = served_model(cfg)
    argv = server_argv(serve_template(cfg), model, host, cfg.server.serve_port)
    return ServeSettings(
        argv=(_executable(argv[0]), *argv[1:]),
        model=model,
        port=cfg.server.serve_port,
        log_path=log_path,
        pid_path=pid_path or log_path.with_name("server.pid"),
        host=host,
        startup_timeout_s=cfg.server.serve_timeout_s,
    )


def served_config(cfg: RunConfig, port: int) -> RunConfig:
    """The config the runner gets: the server's URL, and retries that outlast a restart. Prompts
    go where they go with any ``--base-url`` (:mod:`agents.llm.openai_backend`): to the
    completions endpoint as text, as in process; a ``chat_format`` that wraps them (user,
    prefill) sends them to the chat endpoint instead, and ``raw`` is the completions text."""
    options = dict(cfg.models.backend_options)
    options.setdefault("max_retries", RESTART_RETRIES)
    options.setdefault("backoff_max", RESTART_BACKOFF_MAX_S)
    if cfg.server.serve_data_parallel > 1:
        options.setdefault("data_parallel_size", cfg.server.serve_data_parallel)
    return cfg.replace(
        base_url=f"http://{HOST}:{port}/v1", serve_port=port, backend_options=options
    )


# -- HTTP and processes ------------------------------------------------------------------------
def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes] | None:
    """(status, body) of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except (OSError, ValueError):
        return None


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (for tests and ad-hoc servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` still runs. A zombie does not count: it is dead,
    waiting for its parent to read its exit, and an orphan's new parent (init, in a container
    perhaps a process that never does) may never read it."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True  # after the name: state, parent, group
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(p.decode(errors="replace") for p in raw.split(b"\0") if p)


def process_start(pid: int) -> int | None:
    """When a live process started (clock ticks after boot), None when there is none (or only
    its zombie): with the pid, it names one process, whatever its command line shows."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the name, which may hold spaces
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])  # stat field 22, starttime


def _server_env(extra: dict[str, str]) -> dict[str, str]:
    """The part of a server's environment that changes what it computes, as its pid file records
    it (without a key: ``VLLM_API_KEY``)."""
    env = {**os.environ, **extra}
    return dict(
        redact(
            {
                k: v
                for k, v in sorted(env.items())
                if k.startswith("VLLM_") or k == "CUDA_VISIBLE_DEVICES"
            }
        )
    )


class _LeftServer:
    """A server an earlier runner started (not a child of this process): the part of
    ``subprocess.Popen`` that :class:`ModelServer` uses, read from ``/proc``."""

    def __init__(self, pid: int, started: int) -> None:
        self.pid = pid
        self.started = started

    def poll(self) -> int | None:
        """None while it runs; its exit code is not known here (-1)."""
        return None if process_start(self.pid) == self.started else -1

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.1)
        return code


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-400:]


class ModelServer:
    """One supervised server process (group). Use as a context manager, or start()/stop()."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.restarts = 0
        self.events: list[dict[str, Any]] = []
        self.failed: str | None = None  # why the supervisor gave up, if it did
        self._proc: subprocess.Popen[bytes] | _LeftServer | None = None
        self._log: Any = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ModelServer:
        """Start the server and wait until it is ready; raises ServeError naming the log."""
        s = self.settings
        s.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(s.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in stop()
        try:
            self._clear_port()  # or takes over a server an earlier run left
            if self._proc is None:
                self._spawn()
            self._wait_ready(self._proc_or_fail())
        except BaseException:
            self._stop_process()
            self._close_log()
            raise
        self._thread = threading.Thread(
            target=self._supervise, name="serve-supervisor", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising, then SIGTERM the process group, SIGKILL after the grace period."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop_process()
        if self._log is not None:
            self._note("stopped", restarts=self.restarts)
        self._close_log()

    # -- internals -----------------------------------------------------------------------------
    def _note(self, event: str, **details: Any) -> None:
        record = redact({"t": time.time(), "event": event, **details})
        self.events.append(record)
        text = redact(" ".join(f"{k}={v}" for k, v in details.items()))
        log.info("server %s %s", event, text)
        if self._log is not None:
            try:
                self._log.write(f"[reflexsim serve] {event} {text}\n".encode())
            except (OSError, ValueError):
                pass

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _proc_or_fail(self) -> subprocess.Popen[bytes] | _LeftServer:
        assert self._proc is not None
        return self._proc

    def _clear_port(self) -> None:
        s = self.settings
        old, same = self._orphan()
        if old is not None and same and self._ready_now():
            self._note("reusing a server left by an earlier run", pid=old.pid)
            self._proc = old
            return
        if old is not None:  # another command, or not answering (yet): it goes
            self._note("stopping a server left by an earlier run", pid=old.pid)
            _signal_group(old.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                old.poll() is not None and port_free(s.host, s.port)
            ):
                time.sleep(0.2)
        if not port_free(s.host, s.port):
            raise ServeError(
                f"port {s.port} on {s.host} is in use by another program: stop it, or pick a "
                "free port with --serve-port (a resumed run then needs --force)"
            )

    def _orphan(self) -> tuple[_LeftServer | None, bool]:
        """A live server this run started earlier (the process its pid file names), and whether
        it runs this server's command in this server's environment."""
        s = self.settings
        try:
            info = json.loads(s.pid_path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, False
        started = process_start(pid)
        if started is None:
            return None, False
        if "started" in info:
            alive = info["started"] == started
        else:  # a pid file of an older version: the command line as recorded
            alive = _cmdline(pid) == tuple(info.get("argv", ()))
        if not alive:
            return None, False
        same = info.get("argv") == redact(list(s.argv)) and info.get("env") == _server_env(s.env)
        return _LeftServer(pid, started), same

    def _ready_now(self) -> bool:
        """Whether the server on the port is healthy and serves the model now."""
        s = self.settings
        health = _get(f"{s.root_url}/health")
        models = _get(f"{s.url}/models") if health and health[0] in (200, 404) else None
        return models is not None and models[0] == 200 and s.model in _model_ids(models[1])

    def _spawn(self) -> None:
        s = self.settings
        self._note("starting", command=shlex.join(s.argv))
        env = {**os.environ, **s.env}
        try:
            self._proc = subprocess.Popen(
                [*LOG_PIPE, str(s.log_path), "--", *s.argv],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one signal reaches its children
                env=env,
            )
        except OSError as exc:
            raise ServeError(f"cannot start {s.argv[0]!r}: {exc.strerror or exc}") from None
        pid = self._proc.pid
        record = {"pid": pid, "started": process_start(pid), "argv": redact(list(s.argv))}
        s.pid_path.write_text(json.dumps({**record, "env": _server_env(s.env)}) + "\n")

    def _wait_ready(self, proc: subprocess.Popen[bytes] | _LeftServer) -> None:
        s = self.settings
        started = time.monotonic()
        deadline = started + s.startup_timeout_s
        healthy = False
        while True:
            if self._stopping.is_set():
                raise ServeError("stopped while the server was starting")
            code = proc.poll()
            if code is not None:
                raise ServeError(
                    f"{Path(s.argv[0]).name} exited with code {code} before it was ready "
                    f"(last lines: {_tail(s.log_path)})",
                    s.log_path,
                )
            if time.monotonic() > deadline:
                raise ServeError(
                    f"{Path(s.argv[0]).name} was not ready after {s.startup_timeout_s:.0f}s (raise "
                    f"serve_timeout_s if it needs longer; last lines: {_tail(s.log_path)})",
                    s.log_path,
                )
            if not healthy:
                got = _get(f"{s.root_url}/health")
                healthy = got is not None and got[0] in (200, 404)
            if healthy:
                got = _get(f"{s.url}/models")
                if got is not None and got[0] == 200:
                    ids = _model_ids(got[1])
                    if s.model in ids:
                        self._note("ready", after_s=round(time.monotonic() - started, 2))
                        return
                    raise ServeError(
                        f"the server on port {s.port} serves {ids}, not {s.model!r}: "
                        "check serve-command (vLLM: --served-model-name)"
                    )
            time.sleep(s.poll_s)

    def _supervise(self) -> None:
        s = self.settings
        last_check = time.monotonic()
        bad = 0
        while not self._stopping.wait(s.poll_s):
            proc = self._proc_or_fail()
            code = proc.poll()
            reason = None
            if code is not None:
                reason = f"exited with code {code}"
            elif time.monotonic() - last_check >= s.health_every_s:
                last_check = time.monotonic()
                got = _get(f"{s.root_url}/health", timeout=5.0)
                bad = 0 if got is not None and got[0] in (200, 404) else bad + 1
                if bad >= s.unhealthy_after:
                    reason = f"unhealthy ({bad} failed health checks in a row)"
            if reason is None:
                continue
            bad = 0
            if not self._restart(reason):
                return

    def _restart(self, reason: str) -> bool:
        s = self.settings
        with self._lock:
            self._note("died", reason=reason, pid=self.pid)
            self._stop_process(grace=0.0)
            while self.restarts < s.max_restarts:
                if self._stopping.is_set():
                    return False
                self.restarts += 1
                self._note("restart", attempt=f"{self.restarts}/{s.max_restarts}")
                try:
                    self._spawn()
                    self._wait_ready(self._proc_or_fail())
                    return True
                except ServeError as exc:
                    self._note("restart failed", error=str(exc))
                    self._stop_process(grace=0.0)
            self.failed = f"gave up after {s.max_restarts} restarts ({reason})"
            self._note("gave up", reason=self.failed)
            return False

    def _stop_process(self, grace: float | None = None) -> None:
        proc = self._proc
        if proc is None:
            return
        grace = self.settings.stop_grace_s if grace is None else grace
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        _signal_group(pgid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so that it no longer counts as a member
            if not group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        end = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < end:
            _signal_group(pgid, signal.SIGKILL)
            time.sleep(0.1)
        self._proc = None


def _model_ids(body: bytes) -> list[str]:
    try:
        data = json.loads(body)
        return [str(m.get("id")) for m in data.get("data", [])]
    except (ValueError, AttributeError, TypeError):
        return []


# -- running a served config ---------------------------------------------------------------------
@contextmanager
def stop_server_on_signals() -> Iterator[None]:
    """While a server runs, SIGTERM and SIGHUP raise KeyboardInterrupt, so that ``finally``
    blocks stop it: it runs in its own session, and a killed runner would leave it holding the
    GPU. A signal already ignored (``nohup``) stays ignored, and one that already has a handler
    (the CLI's SIGTERM: ``experiments.errors.Terminated``) keeps it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            saved[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# -- replicas on a Ray cluster ----------------------------------------------------------------------------
class ReplicaActor:
    """A Ray actor that runs one supervised model server on its node, on the node's address."""

    def __init__(self) -> None:
        self.server: Any = None

    def start(self, values: dict[str, Any], index: int, run_dir: str) -> dict[str, Any]:
        import ray  # lazily: ray is an optional extra

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


@contextmanager
def serve_replicas(cfg: RunConfig, run_dir: Path) -> Iterator[list[dict[str, Any]]]:
    """``serve_replicas`` model servers started as Ray actors (each reserving the model's GPUs,
    spread over the nodes), connected to ``--ray`` while the block runs. Yields each one's URL,
    node and log; when the block ends they are stopped, and each entry gets how it ended."""

    with session(str(cfg.cluster.address)) as ray:
        options = {"num_cpus": 1, **gpu_options(cfg, model_gpus(cfg))}
        check_fits("serve replica", options, alive_nodes(ray))
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
            log.info("serving %s on %s", cfg.models.model, ",".join(i["url"] for i in infos))
            yield infos
        finally:
            ends = _stop_replicas(ray, actors)
            for info, end in zip(infos, ends, strict=False):
                info.update(end)


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
