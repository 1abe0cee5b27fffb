"""``reflexsim`` command line: run, resume, games, export, report, view, replay.

The only place that reads argv and turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agents.llm.redaction import redact
from experiments.errors import (
    ConfigError,
    InfraError,
    RunStoreError,
    Terminated,
    is_disk_full,
)
from experiments.progress import Eta
from experiments.terminal import EscapingFormatter, escape_controls

# Exit codes (README "Exit codes"): 0 finished (complete, or stopped by its budget/deadline);
# 1 a preset job failed; 2 bad input or an unusable run directory; 3 finished, but tasks were
# left by infrastructure errors (--resume retries them); 130 SIGINT, 143 SIGTERM (stopped
# mid-way, everything played is kept; --resume plays the rest).
USAGE_ERROR = 2
INFRA_ERRORS = 3
INTERRUPTED = 130

Handler = Callable[[argparse.Namespace], int]


def _games_generate(args: argparse.Namespace) -> int:
    from envs.alfgen import generate  # lazily: envs loads gymnasium and numpy

    paths = generate(
        args.out,
        per_type=args.per_type,
        seed=args.seed,
        task_types=args.task_types,
        split=args.split,
    )
    print(f"wrote {len(paths)} games under {args.out}")
    return 0


def _games_stats(args: argparse.Namespace) -> int:
    from envs.alfgen.stats import stats_report  # lazily: envs loads gymnasium and numpy

    print(stats_report(args.dir))
    return 0


def _run(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments import matrix
    from experiments.config import resolve
    from experiments.session import RunSession, recorded_config

    if args.resume and matrix.is_matrix_dir(args.resume):
        return _run_matrix(args, None)
    if args.config:
        preset = matrix.load_preset(args.config)
        if preset.is_matrix:
            return _run_matrix(args, preset)
        args.config = str(preset.path)  # a preset's bare name
    cfg = resolve(args, recorded_config(args.resume) if args.resume else None)
    if args.dry_run:
        print(json.dumps(redact(matrix.plan_job(cfg)), indent=1, default=str))
        return 0
    session = RunSession(cfg, resume=args.resume, force=args.force)
    try:
        run_dir = session.run(ConsoleProgress(verbose=args.verbose))
    except KeyboardInterrupt as exc:
        exc.add_note(_what_is_left(session.run_dir))
        raise
    report = _write_report_if_available(run_dir)
    print(f"run: {run_dir}")
    if report is not None:
        print(f"report: {report}")
    return _run_outcome(run_dir)


def _what_is_left(run_dir: Path) -> str:
    """What an interrupted run's line says: how to go on, when anything was kept."""
    from experiments.store import DB_NAME  # lazily: the CLI imports only what the command runs

    if (run_dir / DB_NAME).is_file():
        return f"what was played is kept; --resume {run_dir} plays the rest"
    return "before the run began (nothing was played or kept): run the same command again"


def _run_outcome(run_dir: Path) -> int:
    """The exit code of a run that returned, from the state its store derives (a line says
    what is left when it is not complete)."""
    from experiments import matrix  # lazily: the CLI imports only what the chosen command runs

    status, state = matrix.job_state(run_dir)
    if state is None or state.complete:
        return 0
    if state.stopped:
        left = state.tasks - state.finished
        print(f"stopped: {state.stopped}; {_n(left, 'task')} left (--resume {run_dir} goes on)")
        return 0
    if status == "errors":
        print(f"unfinished: {matrix.errors_note(state)}: reflexsim run --resume {run_dir}")
        return INFRA_ERRORS
    print(f"unfinished ({status}): reflexsim run --resume {run_dir} plays the rest")
    return INFRA_ERRORS


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ConsoleProgress:
    """The run's start, a live progress line (solved tasks, tokens, ETA) and nothing else.

    On a terminal the line is a progress bar; written to a file (an overnight batch under
    ``nohup`` or a job scheduler) it is a plain line at most every ``every_s`` seconds, so the
    log says how far the run is without a carriage return in it."""

    def __init__(
        self,
        verbose: bool = False,
        stream: Any = None,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.verbose = verbose
        self.stream = stream or sys.stderr
        self.every_s, self.clock = every_s, clock
        self.bar: Any = None
        self.tasks = self.solved = 0
        self.total = self.done = self.tokens = 0
        self.began = self.last_line = 0.0
        self.max_steps = 30
        self.eta: Eta | None = None

    def begin(self, summary: dict[str, Any]) -> None:
        s = summary
        self.max_steps = int(s.get("max_steps", self.max_steps))
        again = " (resumed)" if s.get("resumed") else ""
        print(f"starting run{again} in {s['run_dir']}", file=self.stream)
        print(
            f"  model {s['model']}, arm {s['arm']}, {_n(s['games'], 'game')} "
            f"({s['game_source']}), {_n(s['trials'], 'trial')}, {s['concurrency']} in flight on "
            f"{_n(s['workers'], 'env worker')}",
            file=self.stream,
        )
        print(f"  config: {s['config_file']}", file=self.stream)
        if self.verbose:
            print(json.dumps(s["config"], indent=1, default=str), file=self.stream)

    def start(self, tasks: int, episodes_at_most: int, solved: int) -> None:
        self.tasks, self.solved, self.total = tasks, solved, episodes_at_most
        self.began = self.last_line = self.clock()
        self.eta = Eta(self.max_steps, self.began)
        if self.stream.isatty():
            from tqdm import tqdm  # lazily: tqdm costs ~90 ms; only a terminal shows the bar

            self.bar = tqdm(
                total=episodes_at_most,
                unit="ep",
                desc="episodes",
                file=self.stream,
                # the ETA is ours (see Eta): tqdm's own counts finished episodes only
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )
            self._postfix(0)

    def _eta(self, now: float) -> str:
        """The time left, as the progress shows it."""
        left = max(0, self.total - self.done)
        seconds = None if self.eta is None else self.eta.seconds_left(now, left)
        if seconds is None and self.done:  # no steps recorded (a tree search): by episodes
            seconds = (now - self.began) / self.done * left
        return "?" if seconds is None else _duration(seconds)

    def _postfix(self, tokens: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                solved=f"{self.solved}/{self.tasks}", tokens=tokens, ETA=self._eta(self.clock())
            )

    def _line(self) -> None:
        """The plain progress line, when ``every_s`` has passed since the last one."""
        now = self.clock()
        if now - self.last_line < self.every_s:
            return
        self.last_line = now
        elapsed = now - self.began
        print(
            f"  episodes {self.done}/{self.total}, solved {self.solved}/{self.tasks}, "
            f"{self.tokens:,} tokens, {_duration(elapsed)} elapsed, ETA {self._eta(now)}",
            file=self.stream,
            flush=True,
        )

    def step_done(self, episode: str) -> None:
        if self.eta is not None:
            self.eta.step(episode)

    def episode_done(self, won: bool, tokens: int, episode: str = "") -> None:
        self.done, self.tokens = self.done + 1, tokens
        if self.eta is not None:
            self.eta.episode_done(episode)
        if self.bar is not None:
            self.bar.update(1)
            self._postfix(tokens)
        else:
            self._line()

    def task_done(self, won: bool, episodes_saved: int) -> None:
        self.solved += int(won)
        self.total = max(self.done, self.total - episodes_saved)
        if self.bar is not None and episodes_saved:
            self.bar.total = self.total  # one count of what is left, for the bar and the line
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        print(f"solved {self.solved}/{self.tasks} tasks", file=self.stream)


def _run_matrix(args: argparse.Namespace, preset: Any) -> int:
    """A preset with jobs: each job in <run dir>/<name>, one report; 1 if a job failed."""
    # lazily: the CLI imports only what the chosen command runs
    from experiments import matrix
    from experiments.config import flag_values

    flags = flag_values(args)
    if args.dry_run:
        if preset is None:
            state = matrix.read_state(Path(args.resume))
            preset = matrix.preset_from_dict(state["preset"])
            flags = {**state.get("flags", {}), **flags}
        run_dir = Path(args.resume or args.run_dir) if (args.resume or args.run_dir) else None
        plan = matrix.plan_matrix(preset, flags, run_dir)
        print(json.dumps(redact(plan), indent=1, default=str))
        return 0
    if args.resume:
        result = matrix.run_matrix(None, flags, Path(args.resume), resume=True, force=args.force)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else None
        result = matrix.run_matrix(preset, flags, run_dir, force=args.force)
    for name, r in result.jobs.items():
        error = f"  ({escape_controls(str(r['error']))})" if r.get("error") else ""
        print(f"{name}: {r.get('status')}  {r.get('run_dir')}{error}")
    print(f"matrix: {result.run_dir}")
    if result.report is not None:
        print(f"report: {result.report}")
    return 1 if result.failed else INFRA_ERRORS if result.with_errors else 0


def _write_report_if_available(run_dir: Path) -> Path | None:
    try:
        # lazily: the CLI imports only what the chosen command runs
        from experiments.report import write_report

        return write_report([run_dir])
    except ImportError:  # scipy or matplotlib (imported when used) missing: `report` makes it later
        return None


def _export(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.export import export
    from experiments.training_data import FORMATS, export_training

    out = Path(args.out) if args.out else None
    if args.format in FORMATS:
        print(export_training(Path(args.run_dir), args.format, out, force=args.force))
        return 0
    for path in export(Path(args.run_dir), args.format, out):
        print(path)
    return 0


def _report(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.report import write_report

    try:
        out = write_report([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None)
    except OSError as exc:
        if is_disk_full(exc) or exc.filename is None:
            raise
        # a run on a read-only mount, a file in the way: say where, and where else to write
        raise RunStoreError(
            f"cannot write the report: {exc.filename} ({exc.strerror}): pass --out DIR, a "
            "folder you can write to"
        ) from None
    print(out)
    return 0


def _extract(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.experience import extract_rules

    options = dict(args.backend_options or {})
    if args.base_url:
        options["base_url"] = args.base_url
    kept = extract_rules(args.run_dir, args.model, options=options)
    print(f"{len(kept['rules'])} rule(s) from {len(kept['steps'])} call(s) kept in {args.run_dir}")
    return 0


def _experience(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.experience import summary

    print(json.dumps(summary(args.run_dir, args.baseline), indent=2))
    return 0


def _view(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.viewer import serve

    server = serve(Path(args.run_dir), host=args.host, port=args.port)
    try:
        print(f"serving {args.run_dir} at {server.url} (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as exc:  # how a viewer is stopped: nothing to resume, no message
        return Terminated.exit_code if isinstance(exc, Terminated) else INTERRUPTED
    finally:
        server.shutdown()


def _replay(args: argparse.Namespace) -> int:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.replay import replay

    replay(Path(args.run_dir), args.game, args.trial, sys.stdout, prompts=args.prompts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # lazily: the CLI imports only what the chosen command runs
    from experiments.config import KeyValue, add_run_arguments

    parser = argparse.ArgumentParser(prog="reflexsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run a Reflexion experiment (same as run_alfworld.py)",
        usage="%(prog)s [options]  (--help lists every key)",
    )
    add_run_arguments(run)
    run.set_defaults(handler=_run)

    exp = sub.add_parser(
        "export",
        help="write a run's episodes and steps as JSONL or CSV, or its episodes as training "
        "data: sft (won episodes as chat messages) or preference (failed trial vs. won retry)",
    )
    exp.add_argument("run_dir")
    exp.add_argument("--format", choices=("jsonl", "csv", "sft", "preference"), default="jsonl")
    exp.add_argument(
        "--out",
        help="output dir (default: RUN_DIR/export); sft and preference: also a .jsonl file",
    )
    exp.add_argument(
        "--force", action="store_true", help="sft and preference: replace an existing file"
    )
    exp.set_defaults(handler=_export)

    rep = sub.add_parser("report", help="summary.json, plots and tables of one or more runs")
    rep.add_argument("run_dirs", nargs="+")
    rep.add_argument("--out", help="output dir (default: FIRST_RUN_DIR/report)")
    rep.set_defaults(handler=_report)

    ext = sub.add_parser(
        "extract", help="make the rule list of a gathering run (kept in its store) with a model"
    )
    ext.add_argument("run_dir")
    ext.add_argument("--model", required=True, help="model spec that writes the rules")
    ext.add_argument("--base-url", help="the model's OpenAI-compatible server (as for run)")
    ext.add_argument(
        "--backend-option",
        dest="backend_options",
        action=KeyValue,
        metavar="KEY=VALUE",
        help="an option of the model's backend, as for run (max_retries=2, timeout=30, ...)",
    )
    ext.set_defaults(handler=_extract)

    xp = sub.add_parser(
        "experience",
        help="what experience did in a run: rule growth per extraction step, the rules and "
        "retrieved games each episode saw, success per task type (beside --baseline's)",
    )
    xp.add_argument("run_dir")
    xp.add_argument("--baseline", help="a run on the same games without experience")
    xp.set_defaults(handler=_experience)

    view = sub.add_parser("view", help="serve the replay viewer on 127.0.0.1")
    view.add_argument("run_dir")
    view.add_argument("--host", default="127.0.0.1")
    view.add_argument("--port", type=int, default=8765)
    view.set_defaults(handler=_view)

    rp = sub.add_parser("replay", help="replay one episode in the terminal")
    rp.add_argument("run_dir")
    rp.add_argument("--game", required=True, help="game id")
    rp.add_argument("--trial", type=int, default=0)
    rp.add_argument(
        "--prompts", action="store_true", help="print each step's request as the run recorded it"
    )
    rp.set_defaults(handler=_replay)

    games = sub.add_parser("games", help="make or list games").add_subparsers(
        dest="games_command", required=True
    )
    gen = games.add_parser(
        "generate", help="generate new ALFWorld games in the $ALFWORLD_DATA layout"
    )
    gen.add_argument("--out", required=True, help="data root to write into")
    gen.add_argument("--per-type", type=int, default=5, help="games per task type")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--task-types", nargs="+", default=None, help="subset: put clean heat cool examine puttwo"
    )
    gen.add_argument(
        "--split",
        default="train",
        help="split folder to write (train, eval_in_distribution, eval_out_of_distribution)",
    )
    gen.set_defaults(handler=_games_generate)
    st = games.add_parser(
        "stats", help="what an agent faces in a folder of games, beside ALFWorld's train split"
    )
    st.add_argument("dir", help="a folder of ALFWorld games, real or generated (searched in depth)")
    st.set_defaults(handler=_games_stats)
    return parser


# The loggers whose notes (INFO) the console shows: a run's own (e.g. games generated on a
# first run), always; a matrix's, when its level lets them through
RUN_NOTES = ("reflexsim.runner", "reflexsim.games")


def _console_logging() -> None:
    """Warnings of the project's loggers, and the runner's own notes (e.g. games being
    generated on a first run), on stderr; everything else goes to the run's run.log."""

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(message)s"))
    handler.setLevel(logging.INFO)
    handler.addFilter(
        lambda r: r.levelno >= logging.WARNING or r.name in (*RUN_NOTES, "reflexsim.matrix")
    )
    handler.set_name("reflexsim-console")  # one per logger, however often main() runs
    for name in ("reflexsim", "agents", "envs"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == handler.get_name()]:
            logger.removeHandler(old)
        logger.addHandler(handler)
    for name in RUN_NOTES:
        logging.getLogger(name).setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    _console_logging()
    parser = build_parser()
    terminated: list[int] = []
    restore = _handle_sigterm(terminated)
    try:
        # a flag's value is read here (--backend-option KEY=YAML): a bad one is one line too
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        handler: Handler = args.handler
        return handler(args)
    except KeyboardInterrupt as exc:
        code = Terminated.exit_code if terminated or isinstance(exc, Terminated) else INTERRUPTED
        name = "SIGTERM" if code == Terminated.exit_code else "SIGINT"
        notes = getattr(exc, "__notes__", None)  # the command's own word on what is left
        left = notes[-1] if notes else "what was played is kept; --resume <run dir> plays the rest"
        _say(f"interrupted ({name}): {left}")
        return code
    except BrokenPipeError:
        return _output_closed()
    except InfraError as exc:  # the model server failed outside an episode: run it again
        _say(f"reflexsim: error: {escape_controls(redact(str(exc)))}")
        return INFRA_ERRORS
    except Exception as exc:  # user-facing errors become one line; bugs keep their traceback
        if _is_user_error(exc):
            message = escape_controls(redact(str(exc)))
            if is_disk_full(exc):
                message = f"the disk is full ({message}): free space, then run it again"
            _say(f"reflexsim: error: {message}")
            return USAGE_ERROR
        raise
    finally:
        restore()
        _flush_quietly()


def _handle_sigterm(terminated: list[int]) -> Callable[[], None]:
    """SIGTERM (a scheduler's preemption, ``kill``) is handled like Ctrl-C: inside a run's event
    loop, SIGINT's handler cancels the run (its ``finally`` commits what was played); elsewhere
    ``Terminated`` is raised. ``terminated`` records it, for the exit code 143. Returns what
    puts the previous handler back. A SIGTERM already ignored (``nohup``) stays ignored."""

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return lambda: None

    def on_sigterm(signum: int, frame: Any) -> None:
        terminated.append(signum)
        on_sigint = signal.getsignal(signal.SIGINT)
        if len(terminated) == 1 and callable(on_sigint):
            if on_sigint is not signal.default_int_handler:
                on_sigint(signal.SIGINT, frame)  # asyncio.run's: cancels the main task
                return
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a reader that stopped reading


def _output_closed() -> int:
    """The reader of stdout or stderr went away (``reflexsim replay ... | head``, ``reflexsim
    view RUN 2>&1 | head -1``): not an error of ours. Python's documented way: point them at
    devnull so the flush at exit cannot raise again."""

    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass  # no file behind it (a test's capture): nothing will flush into a pipe
    return BROKEN_PIPE


def _say(line: str) -> None:
    """A line of the CLI's own on stderr, even when its reader went away."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        _output_closed()


def _flush_quietly() -> None:
    """What is left in stdout's buffer, written now: a closed pipe is not a traceback at exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _output_closed()
    except (OSError, ValueError):
        pass


def _is_user_error(exc: BaseException) -> bool:
    # lazily: the CLI imports only what the chosen command runs (envs loads gymnasium)
    from agents.llm.base import MissingDependencyError, SpecError
    from envs.errors import EnvError

    if is_disk_full(exc):
        return True  # writing a report, config.yaml, an export (the store says so itself)
    return isinstance(
        exc, EnvError | ConfigError | RunStoreError | SpecError | MissingDependencyError
    )


if __name__ == "__main__":
    raise SystemExit(main())
