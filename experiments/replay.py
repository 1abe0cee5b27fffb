"""Replay one episode in the terminal, step by step, from the run store (read-only)."""

from __future__ import annotations

import difflib
import os
import textwrap
from pathlib import Path
from typing import TextIO

from agents.prompting import transcript_action
from experiments.errors import RunStoreError
from experiments.prompts import request_text, step_prompts
from experiments.store import RunReader, episode_id, open_reader
from experiments.terminal import escape_controls as _clean
from experiments.viewer.data import prompt_memory
from memory.records import EpisodeStatus, StepKind

_COLORS = {"won": "32", "failed": "31", "error": "33", "dim": "2", "bold": "1", "warn": "33"}


def _use_color(out: TextIO) -> bool:
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty()) and "NO_COLOR" not in os.environ


def replay(run_dir: Path, game: str, trial: int, out: TextIO, prompts: bool = False) -> None:
    """Print episode ``game`` / ``trial`` of the run; plain text unless ``out`` is a terminal.
    ``prompts``: each step's request too, as the run recorded it (rebuilt ones say so). Every
    model call made for the episode follows the steps, with its prompt (a step's: with
    ``prompts``) and its answer."""
    color = _use_color(out)

    def paint(text: str, style: str) -> str:
        return f"\x1b[{_COLORS[style]}m{text}\x1b[0m" if color else text

    def block(text: str, indent: str = "  ") -> str:
        return textwrap.indent(_clean(text), indent, lambda line: True)

    with open_reader(Path(run_dir)) as reader:
        row = reader.episode(episode_id(game, trial))
        if row is None:
            raise RunStoreError(_missing(reader, game, trial, run_dir))
        steps = reader.steps(row.episode_id)
        after = [r for r in reader.reflections(row.game) if r.trial == row.trial]
        calls = reader.episode_calls(row)
        asked = step_prompts(reader, row, steps, calls=calls)
    made = {id(p.call) for p in asked if p.call is not None}

    if row.won:
        outcome = paint("WON", "won")
    elif row.status is EpisodeStatus.ERROR:
        outcome = paint("ERROR (harness)", "error")
    elif row.status in (EpisodeStatus.RUNNING, EpisodeStatus.INTERRUPTED):
        outcome = paint(row.status.value.upper(), "warn")
    else:
        outcome = paint("FAILED", "failed")
    w = out.write
    w(paint(f"{_clean(row.game)}  trial {row.trial}  [{row.arm}]", "bold") + f"  {outcome}\n")
    if row.task:
        w(f"task: {_clean(row.task)}\n")
    w(f"type: {row.task_type}   steps: {len(steps)}   status: {row.status.value}\n")
    memory = prompt_memory(row)
    if memory:
        w("\nreflections in the prompt:\n")
        for r in memory:
            w(f"  trial {r['trial']}:\n{block(r['text'], '    ')}\n")
    w("\n" + block(row.observation, "") + "\n")
    for s, asked_at in zip(steps, asked, strict=True):
        w("\n")
        if prompts:
            source = "rebuilt from the steps (not recorded)" if asked_at.rebuilt else "as sent"
            w(paint(f"[{s.index}] prompt, {source}:", "dim") + "\n")
            w(paint(block(asked_at.shown, "    | "), "dim") + "\n")
        if s.kind == StepKind.THINK:
            w(paint(f"[{s.index}] ", "dim") + f"> {_clean(transcript_action(s))}\n")
        elif s.kind == StepKind.INVALID:
            w(paint(f"[{s.index}] ", "dim") + paint("(invalid output)", "failed") + "\n")
            w(block(s.raw_output or "(empty)", "    raw: ") + "\n")
        else:
            flag = "" if s.admissible else "  " + paint("[not admissible]", "warn")
            shown = transcript_action(s)
            w(paint(f"[{s.index}] ", "dim") + f"> {_clean(shown)}{flag}\n")
            if s.raw_output.strip() != shown:
                w(paint(block(s.raw_output, "    raw: "), "dim") + "\n")
        w(block(s.observation) + "\n")
    w("\n" + "-" * 60 + "\n")
    w(f"outcome: {outcome}")
    if row.failure_class and not row.won:
        w(f"   failure class: {row.failure_class.value}")
    w("\n")
    if row.verdict:
        w(f"evaluator verdict: {_clean(row.verdict)}\n")
    if row.judge_verdict:
        reason = f" ({_clean(row.judge_reason)})" if row.judge_reason else ""
        w(f"judge verdict: {row.judge_verdict}{reason}\n")
    if row.error:
        w(f"harness error: {_clean(row.error)}\n")
    if after:
        w(f"\nreflection written after this trial:\n{block(after[0].text)}\n")
    if calls:
        w(f"\nmodel calls ({len(calls)}):\n")
    for c in calls:
        where = f"trial {c.trial}" if c.step is None else f"step {c.step}"
        retried = f", {c.retries} retries" if c.retries else ""
        w(f"  {c.purpose} ({where}): {c.prompt_tokens} prompt + {c.completion_tokens}"
          f" completion tokens{retried}" + ("" if c.sent else ", request not recorded") + "\n")  # fmt: skip
        for e in c.attempt_errors:
            w(paint(block(e, "    failed attempt: "), "warn") + "\n")
        if c.error:
            w(paint(block(c.error, "    error: "), "error") + "\n")
        if c.sent is not None and (prompts or id(c) not in made):
            w(paint(block(request_text(c.sent), "    | "), "dim") + "\n")
        if c.answer is not None and id(c) not in made:
            w(block(c.answer, "    answer: ") + "\n")


def _missing(reader: RunReader, game: str, trial: int, run_dir: Path) -> str:
    outcomes = reader.outcomes()
    games = sorted({o.game for o in outcomes})
    if game in games:
        trials = [o.trial for o in outcomes if o.game == game]
        return f"game {game!r} has no trial {trial} in {str(run_dir)!r}: its trials are {trials}"
    close = difflib.get_close_matches(game, games, n=1, cutoff=0.3)
    hint = f": did you mean {close[0]!r}?" if close else f" (it has {len(games)} games)"
    return f"no game {game!r} in {str(run_dir)!r}{hint}"
