"""One run's life: ``RunSession(cfg, resume, force).run(progress)``.

The session resolves the run directory once (unset: ``runs/<time>-<model>-<arm>``), decides
between a new run, a resume and a forced resume, selects the games once, checks everything that
needs nothing started, takes the run directory's lock (one writer per directory), starts and
stops the model server of a served run (``--serve``: :class:`experiments.serve.ModelServer`, or
replicas on Ray), builds the models and the manifest (compared with the recorded one on a
resume), opens the one run store handle, has :func:`experiments.runner.execute` play the run
into it, and records what came after (the server's restarts, a Ray job's placement) through
that same handle. Everything it opened is closed by one ``ExitStack``, in reverse order.

A refused run leaves nothing behind that blocks the corrected command: a new run's lock (which
makes the directory) is taken only once every check passed, or just before its server starts;
a new run that ends before its store is made (a server that does not start, an experience source
that cannot be locked, an interrupt in the extract phase) leaves its directory as it found it:
its lock file, server log and pid file go (a server's log with something in it is moved to the
temporary folder, and the error names it), and a directory it made goes when empty.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

from agents.experience import Experience
from agents.llm.redaction import redact
from experiments import shards
from experiments.arming import (
    check_device_share,
    check_prompts_file,
    code_prompts,
    generation_config,
    instruction,
    prompt_file_hashes,
)
from experiments.config import RunConfig, data_root
from experiments.errors import RunStoreError
from experiments.experience import for_run as experience_for
from experiments.experience import needs_rules, with_current_rules
from experiments.games import GameSet, select_games
from experiments.lock import DirLock
from experiments.manifest import build_manifest, manifest_differences, resumed_manifest
from experiments.progress import Progress
from experiments.ray_session import import_ray
from experiments.runner import Backends, Plan, execute, open_backends
from experiments.serve import (
    ModelServer,
    ServeError,
    check_serve,
    serve_replicas,
    serve_settings,
    served_config,
    stop_server_on_signals,
)
from experiments.store import DB_NAME, LOCK_NAME, RunStore

SERVER_EVENTS = ("died", "restart", "restart failed", "gave up")  # recorded in the run store
# what a session makes in a run directory before its store: gone again when the run is refused
BEFORE_THE_STORE = (LOCK_NAME, "server*.log", "server*.pid")


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.models.model)[:40]
    return Path("runs") / f"{stamp}-{model}-{cfg.protocol.agent.replace('+', '_')}"


def run_dir_of(cfg: RunConfig, resume: str | Path | None = None) -> Path:
    """The run directory: the one resumed, else the config's, else a new default one."""
    if resume:
        return Path(resume)
    if cfg.execution.run_dir:
        return Path(cfg.execution.run_dir)
    return default_run_dir(cfg)


def run_lock(run_dir: Path) -> DirLock:
    """The lock of one writer per run directory, held for the run's whole life."""
    return DirLock(run_dir, LOCK_NAME)


def refuse_existing(run_dir: Path) -> None:
    """A one-line RunStoreError when ``run_dir`` already holds a run (a new run's check)."""
    if (run_dir / DB_NAME).exists():
        raise RunStoreError(
            f"{str(run_dir)!r} already holds a run: use --resume {run_dir} or another --run-dir"
        )


def recorded_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The config a run was made with (its manifest's), which a resume's flags override."""
    store = RunStore(run_dir, readonly=True)
    try:
        manifest = store.get_meta("manifest") or {}
    finally:
        store.close()
    config = manifest.get("config")
    return dict(config) if isinstance(config, dict) else None


def record_notes(run_dir: Path, notes: dict[str, Any]) -> None:
    """``notes`` into the meta of a run no session plays (one already complete), if it has a
    store."""
    if not notes or not (run_dir / DB_NAME).is_file():
        return
    store = RunStore(run_dir)
    try:
        for key, value in notes.items():
            store.set_meta(key, value)
    finally:
        store.close()


class RunSession:
    """One run, new or resumed (``resume``: its directory; ``force``: resume it even if its
    setup changed). ``server``: a model server the caller started and stops (a preset's jobs
    share one); a served run without one starts its own. ``notes``: meta the store records
    when the run ends."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: str | Path | None = None,
        force: bool = False,
        server: ModelServer | None = None,
    ) -> None:
        self.run_dir = run_dir_of(cfg, resume)
        self.cfg = cfg.replace(run_dir=str(self.run_dir))
        self.resume = bool(resume)
        self.force = force
        self.server = server
        self.notes: dict[str, Any] = {}
        self.lock = run_lock(self.run_dir)
        self.store: RunStore | None = None  # the one handle, from the lock until the end
        self._recorded: dict[str, Any] | None = None  # the manifest a resume found
        self._games: GameSet | None = None
        self.experience: Experience | None = None  # other games' experience the run shows
        self._checked = False
        self._found: set[str] | None = None  # what a new run's folder held (None: no folder)
        self._made: list[Path] = []  # the folders a new run makes (its own and missing parents)

    @classmethod
    def job(cls, cfg: RunConfig, force: bool = False) -> RunSession:
        """A preset job's session: it resumes when its directory holds a run already."""
        run_dir = run_dir_of(cfg)
        return cls(cfg, run_dir if (run_dir / DB_NAME).is_file() else None, force)

    @property
    def games(self) -> GameSet:
        """The run's games, selected once."""
        if self._games is None:
            self._games = select_games(self.cfg)
        return self._games

    def check(self) -> None:
        """Every check that needs nothing started: a bad game selection, prompts file or served
        config, ``--ray`` without its extra, or a directory that holds another run (or one that
        a live process writes) is a one-line error now, before a long server start."""
        if self._checked:
            return
        cfg = self.cfg
        if cfg.server.serve:
            check_serve(cfg)
        if cfg.cluster.address:
            import_ray()  # --ray without the extra is a one-line error, here as anywhere
        check_device_share(cfg)  # the config alone: before the games are looked for
        shards.check(cfg)
        instruction(cfg)
        code_prompts(cfg)
        check_prompts_file(cfg, self.games.tasks)
        # other games' experience: a source that would leak into these games is refused here
        self.experience = experience_for(cfg, cfg.gameset.split, self.games.files)
        if not self.resume:
            self.lock.refuse_if_held("a run")
            refuse_existing(self.run_dir)
            if self.run_dir.is_dir():
                self._found = {p.name for p in self.run_dir.iterdir()}
            self._made = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        self._checked = True

    def run(self, progress: Progress | None = None) -> Path:
        """Play the run to its end (or its budget); returns the run directory (its store says
        how it ended: ``RunStore.run_state``)."""
        self.check()
        try:
            with ExitStack() as stack:
                stack.callback(self.lock.release)
                stack.callback(self._close_store)
                if self.resume:
                    self._open_recorded()
                cfg = self._serve(stack) if self.cfg.server.serve else self.cfg
                truth = self.games.ground_truth
                backends = stack.enter_context(closing(open_backends(cfg, truth)))
                self._extract(cfg, backends)
                plan = self._plan(cfg, backends)
                if self.store is None:
                    self._claim()
                    self.store = RunStore(self.run_dir, create=True)
                execute(plan, self.store, progress, shards.player(cfg))
        except BaseException as exc:
            self._leave_as_found(exc)
            raise
        return self.run_dir

    def _leave_as_found(self, exc: BaseException) -> None:
        """A new run that ends before its store is made takes back what it made (its lock is
        released by then, its server stopped); a server's log with something in it is moved to
        the temporary folder, where the error (``exc``) says it is."""
        if self.resume or self.store is not None or not self.run_dir.is_dir():
            return
        found = self._found or set()
        own_server = self.server is None  # the caller's (a preset's shared one) goes on
        for pattern in BEFORE_THE_STORE if own_server else (LOCK_NAME,):
            for path in self.run_dir.glob(pattern):
                if path.name in found or not path.is_file():
                    continue
                if isinstance(exc, ServeError) and exc.log == path and path.stat().st_size:
                    exc.log = _keep_elsewhere(path)
                else:
                    path.unlink(missing_ok=True)
        for made in self._made:  # innermost first; one with anything else in it stays
            try:
                made.rmdir()
            except OSError:
                break

    # -- new or resumed ------------------------------------------------------------------------
    def _claim(self) -> None:
        """Take the directory's lock (it makes the directory); a new run checks once more that
        no other run began there meanwhile."""
        if not self.lock.held:
            self.lock.acquire(what="a run")
            if not self.resume:
                refuse_existing(self.run_dir)

    def _open_recorded(self) -> None:
        """A resume: the lock (a live run is refused before its store is opened), the store,
        and what it recorded."""
        self._claim()
        self.store = RunStore(self.run_dir)
        played = len(self.store.trials())
        self._recorded = self.store.get_meta("manifest")
        if self.cfg.protocol.trials < played:
            raise RunStoreError(
                f"the run in {str(self.run_dir)!r} has started {played} trials: "
                f"resume with --trials {played} or more"
            )

    def _extract(self, cfg: RunConfig, backends: Backends) -> None:
        """The extract phase of a run that shows rules: once the run holds its lock, the rules
        of its experience are made with its reflector, unless kept ones are current."""
        if self.experience is None or not needs_rules(cfg):
            return
        self._claim()
        self.experience = with_current_rules(
            self.experience, backends.reflector, cfg.models.reflector, cfg.models.reflect_max_tokens
        )

    def _plan(self, cfg: RunConfig, backends: Backends) -> Plan:
        """The resolved run, with its manifest: a resume's is the recorded one, refused when
        the setup changed beyond the resumable keys (unless ``force``)."""
        manifest = build_manifest(
            cfg, self.games, backends.actor, backends.reflector, data_root(cfg),
            prompt_file_hashes(cfg), generation_config(cfg),
        )  # fmt: skip
        if self.experience is not None:  # the experience the run shows: its run and digest
            manifest["experience"] = self.experience.provenance.to_json()
        old = self._recorded
        if old is not None:
            diffs = manifest_differences(old, manifest)
            if diffs and not self.force:
                raise RunStoreError(
                    f"the run in {str(self.run_dir)!r} was made with a different setup "
                    f"({'; '.join(diffs[:3])}): resume with the same config, or pass --force"
                )
            manifest = resumed_manifest(old, cfg, diffs)
        return Plan(
            cfg, self.run_dir, self.games, manifest, backends, old is not None, self.experience
        )

    # -- the model server ----------------------------------------------------------------------
    def _serve(self, stack: ExitStack) -> RunConfig:
        """Start the run's model server (or use the caller's), stopped and recorded when the
        stack closes; the config that points the run at it. The lock comes first: it makes the
        directory, where the server's log goes, and is held until the end."""
        self._claim()
        stack.enter_context(stop_server_on_signals())
        if self.cfg.cluster.serve_replicas > 1 and self.server is None:
            return self._serve_replicas(stack)
        server = self.server
        if server is None:
            server = ModelServer(serve_settings(self.cfg, self.run_dir / "server.log")).start()
        stack.callback(self._record_server, server, len(server.events))
        if self.server is None:
            stack.callback(server.stop)  # registered last: it stops before the record above
        return served_config(self.cfg, server.settings.port)

    def _serve_replicas(self, stack: ExitStack) -> RunConfig:
        replicas: list[dict[str, Any]] = []  # each one's URL, node and log; then how it ended

        def record() -> None:
            if replicas:
                self._set_meta("server", {"replicas": replicas})

        stack.callback(record)  # once they are stopped
        replicas.extend(stack.enter_context(serve_replicas(self.cfg, self.run_dir)))
        urls = ",".join(r["url"] for r in replicas)
        if self._recorded is not None:
            self._repoint(urls)
        return served_config(self.cfg, self.cfg.server.serve_port).replace(base_url=urls)

    def _repoint(self, base_url: str) -> None:
        """A resumed run's replicas listen elsewhere now: its manifest gets their URLs (an event
        records the move; which server answers never changes a result)."""
        assert self.store is not None and self._recorded is not None
        config = self._recorded.setdefault("config", {})
        old = config.get("base_url")
        if old != base_url:
            config["base_url"] = base_url
            self.store.set_meta("manifest", self._recorded)
            self.store.log_event("serve_replicas", json.dumps({"from": old, "to": base_url}))

    def _record_server(self, server: ModelServer, first_event: int) -> None:
        """The server's restarts during this run, and how it was run (its log has the rest)."""
        if self.store is None:
            return
        for e in server.events[first_event:]:
            if e["event"] in SERVER_EVENTS:
                self.store.log_event(f"server_{e['event'].replace(' ', '_')}", json.dumps(e))
        self._set_meta(
            "server",
            {
                "command": redact(list(server.settings.argv)),
                "url": server.url,
                "log": str(server.settings.log_path),
                "restarts": server.restarts,
                "failed": server.failed,
            },
        )

    # -- the store -----------------------------------------------------------------------------
    def _set_meta(self, key: str, value: Any) -> None:
        if self.store is not None:
            self.store.set_meta(key, value)

    def _close_store(self) -> None:
        if self.store is None:
            return
        try:
            for key, value in self.notes.items():
                self.store.set_meta(key, value)
        finally:
            self.store.close()


def _keep_elsewhere(log: Path) -> Path:
    """``log`` moved to the temporary folder (a refused run's server log, which its error names)."""
    fd, name = tempfile.mkstemp(prefix=f"reflexsim-{log.parent.name}-", suffix=f"-{log.name}")
    os.close(fd)
    shutil.move(log, name)
    return Path(name)


def run(
    cfg: RunConfig,
    resume: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Prepare and play a run (or resume one); returns the run directory."""
    return RunSession(cfg, resume, force).run(progress)
