"""A run's episodes as training data: SFT conversations and preference pairs (JSON Lines).

The actor's prompts are completion-style and append-only: the prompt of step ``k + 1`` is the
prompt of step ``k``, then the action the transcript shows for step ``k``, then its observation
and the prompt's end. An episode is therefore one chat conversation in the ``messages`` format
that TRL and verl read:

- ``system``: the episode's stored prompt prefix (instruction, examples, memory, task header),
  byte for byte;
- first ``user``: the rest of the first prompt (the first observation and the prompt's end);
- each ``assistant``: what the model wrote at a step as the next prompt shows it (the executed
  action, the thought, or the model's own text for an invalid step), with the space after ``>``;
- each later ``user``: the step's observation and the prompt's end.

Joining the contents of ``messages[:2 + 2k]`` gives the exact prompt the model answered at step
``k``, as the run recorded it (:mod:`experiments.prompts`: the prompt the viewer shows); the
conversation ends with the last answer. The model's raw text of each step is in
``export --format jsonl``. An episode whose prompts are no one conversation (the
``reflexion-code`` protocol's end their text with ``>`` right after the observation, which the
next prompt moves to its own line; a chat-formatted request wraps each prompt in messages) is a
record per step instead: the request as sent (its messages, or the prefix as ``system`` and the
rest as ``user``) and the model's answer, ``metadata.step`` naming the step. ``metadata.prompt``
says whether the prompts were recorded or rebuilt (a store older than the record of requests).

``sft``: one record per won episode (or per step of it, as above). ``preference`` (TRL's ``prompt`` / ``chosen`` /
``rejected``): for each solved task, one pair per failed trial before the winning one. The
prompt is the failed trial's (its prefix and first observation), so a model learns to play the
won trajectory without the reflection that led to it; ``rejected`` and ``chosen`` are the two
trials' turns after the prompt. The reflection written after the failed trial is a field, and
``same_prompt`` says whether the winning trial saw exactly that prompt (false when the
reflection was in its memory). Escalation runs are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.prompting import transcript_action
from experiments.config import ProtocolConfig
from experiments.errors import ConfigError
from experiments.export import unwritable, write_jsonl
from experiments.prompts import StepPrompt, step_prompts
from experiments.store import EpisodeRow, RunReader, RunStatus, open_reader
from memory.records import EpisodeStatus, Step, StepKind

FORMATS = ("sft", "preference")
DEFAULT_PROTOCOL = ProtocolConfig.protocol  # a run whose manifest names none played it

Message = dict[str, str]


@dataclass(frozen=True)
class EpisodeMeta:
    """Where a conversation comes from."""

    run: str  # the run directory's name
    game: str
    task_type: str
    trial: int
    episode_id: str
    model: str
    arm: str
    protocol: str
    steps: int
    invalid_steps: int
    step: int | None = None  # a record of one step (its prompts are no one conversation)
    prompt: str = "recorded"  # recorded | rebuilt (a store older than the record of requests)


@dataclass(frozen=True)
class SftRecord:
    messages: tuple[Message, ...]
    metadata: EpisodeMeta

    def to_dict(self) -> dict[str, Any]:
        return {"messages": list(self.messages), "metadata": dataclasses.asdict(self.metadata)}


@dataclass(frozen=True)
class PreferencePair:
    """A failed trial and the won retry of the same game, after a common prompt."""

    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...]
    reflection: str | None  # written after the rejected trial (None: the arm keeps none)
    same_prompt: bool  # the chosen trial's own prompt is ``prompt``
    chosen_meta: EpisodeMeta
    rejected_meta: EpisodeMeta

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": list(self.prompt),
            "chosen": list(self.chosen),
            "rejected": list(self.rejected),
            "reflection": self.reflection,
            "same_prompt": self.same_prompt,
            "metadata": {
                "chosen": dataclasses.asdict(self.chosen_meta),
                "rejected": dataclasses.asdict(self.rejected_meta),
            },
        }


def conversation(
    episode: EpisodeRow, steps: Sequence[Step], prompts: Sequence[StepPrompt]
) -> list[Message] | None:
    """The episode as one chat conversation (see the module docstring), from the prompts its
    steps answered (:func:`experiments.prompts.step_prompts`); None when they are no one
    conversation (not text that each step's extends, as in the ``reflexion-code`` protocol and
    for chat-formatted requests)."""
    prefix = episode.prompt_prefix
    texts = [p.sent.prompt for p in prompts]
    if not steps or None in texts or not str(texts[0]).startswith(prefix):
        return None
    prompt = [str(t) for t in texts]
    messages = [_message("system", prefix), _message("user", prompt[0][len(prefix) :])]
    lead = None
    for k, step in enumerate(steps):
        shown = transcript_action(step)
        if k + 1 == len(steps):  # the last answer, as the earlier ones are shown
            if lead is None:
                lead = step.raw_output[: len(step.raw_output) - len(step.raw_output.lstrip())]
            messages.append(_message("assistant", lead + shown))
            break
        before, after = prompt[k], prompt[k + 1]
        if not after.startswith(before):
            return None
        added = after[len(before) :]
        start = added.find(shown)
        if start < 0:
            return None
        if shown:
            lead = added[:start]
        end = start + len(shown)
        line_end = added.find("\n", end)  # the answer's line ends before the observation
        cut = line_end if line_end >= 0 else end
        messages.append(_message("assistant", added[:cut]))
        messages.append(_message("user", added[cut:]))
    return messages


def step_messages(episode: EpisodeRow, prompt: StepPrompt) -> list[Message]:
    """One step as its own conversation: the request as sent (chat messages as they are; a text
    prompt as the stored prefix and the rest) and the model's answer."""
    sent = prompt.sent
    answer = prompt.call.answer if prompt.call is not None else prompt.answer
    if sent.messages is not None:
        messages = list(sent.chat)
    elif sent.prompt is not None and sent.prompt.startswith(episode.prompt_prefix):
        prefix = episode.prompt_prefix
        messages = [_message("system", prefix), _message("user", sent.prompt[len(prefix) :])]
    else:
        messages = [_message("user", sent.prompt or "")]
    return [*messages, _message("assistant", answer or "")]


def joined(messages: Iterable[Message]) -> str:
    """The contents of ``messages`` as one text (a prompt, when they end with a user turn)."""
    return "".join(m["content"] for m in messages)


def _message(role: str, content: str) -> Message:
    return {"role": role, "content": content}


def _not_a_conversation(episode: EpisodeRow) -> ConfigError:
    return ConfigError(
        f"episode {episode.episode_id!r} answered prompts that are not append-only text (the "
        "reflexion-code protocol, chat-formatted requests), so its trials make no preference "
        "pair: export it with --format sft (a record per step) or --format jsonl"
    )


class _Run:
    """What the two formats read from one run."""

    def __init__(self, reader: RunReader) -> None:
        config = (reader.get_meta("manifest") or {}).get("config") or {}
        self.reader = reader
        self.name = reader.run_dir.resolve().name
        self.model = str(config.get("model") or "")
        self.protocol = str(config.get("protocol") or DEFAULT_PROTOCOL)
        self.episodes = [e for e in reader.episodes() if e.status is EpisodeStatus.DONE]
        self.steps = reader.all_steps()
        self.reflections = {(r.task, r.trial): r.text for r in reader.reflections()}

    def meta(self, e: EpisodeRow, step: int | None = None, rebuilt: bool = False) -> EpisodeMeta:
        steps = self.steps.get(e.episode_id, [])
        return EpisodeMeta(
            run=self.name, game=e.game, task_type=e.task_type, trial=e.trial,
            episode_id=e.episode_id, model=self.model, arm=e.arm, protocol=self.protocol,
            steps=len(steps), invalid_steps=sum(s.kind == StepKind.INVALID for s in steps),
            step=step, prompt="rebuilt" if rebuilt else "recorded",
        )  # fmt: skip

    def prompts(self, e: EpisodeRow) -> list[StepPrompt]:
        return step_prompts(self.reader, e, self.steps.get(e.episode_id, []), self.protocol)

    def messages(self, e: EpisodeRow) -> list[Message] | None:
        return conversation(e, self.steps.get(e.episode_id, []), self.prompts(e))

    def records(self, e: EpisodeRow) -> list[SftRecord]:
        """The episode as one conversation, else one record per step."""
        prompts = self.prompts(e)
        rebuilt = any(p.rebuilt for p in prompts)
        whole = conversation(e, self.steps.get(e.episode_id, []), prompts)
        if whole is not None:
            return [SftRecord(tuple(whole), self.meta(e, rebuilt=rebuilt))]
        return [
            SftRecord(tuple(step_messages(e, p)), self.meta(e, p.index, p.rebuilt)) for p in prompts
        ]


def sft_records(reader: RunReader) -> list[SftRecord]:
    """The won episodes, by trial then game: each one record, or a record per step where its
    prompts are no one conversation."""
    run = _Run(reader)
    return [
        record
        for e in run.episodes
        if e.won and run.steps.get(e.episode_id)
        for record in run.records(e)
    ]


def preference_pairs(reader: RunReader) -> list[PreferencePair]:
    """For each solved task, each failed trial before its first won one, paired with it."""
    run = _Run(reader)
    by_game: dict[str, list[EpisodeRow]] = {}
    for e in run.episodes:
        by_game.setdefault(e.game, []).append(e)
    pairs = []
    for game in sorted(by_game):
        won = next((e for e in by_game[game] if e.won and run.steps.get(e.episode_id)), None)
        if won is None:
            continue
        chosen = run.messages(won)
        if chosen is None:
            raise _not_a_conversation(won)
        failed_trials = [
            e for e in by_game[game]
            if e.trial < won.trial and not e.won and run.steps.get(e.episode_id)
        ]  # fmt: skip
        for failed in failed_trials:
            rejected = run.messages(failed)
            if rejected is None:
                raise _not_a_conversation(failed)
            pairs.append(
                PreferencePair(
                    prompt=tuple(rejected[:2]),
                    chosen=tuple(chosen[2:]),
                    rejected=tuple(rejected[2:]),
                    reflection=run.reflections.get((game, failed.trial)),
                    same_prompt=chosen[:2] == rejected[:2],
                    chosen_meta=run.meta(won),
                    rejected_meta=run.meta(failed),
                )
            )
    return pairs


def export_training(run_dir: Path, fmt: str, out: Path | None = None, force: bool = False) -> Path:
    """Write the run's ``sft`` or ``preference`` records as JSON Lines; returns the file.

    ``out``: a ``.jsonl`` file, or a folder to write ``<fmt>.jsonl`` into (default:
    ``RUN_DIR/export``). An existing file is replaced only with ``force``; a run that is
    missing, not a run, still running or unfinished is a one-line ConfigError/RunStoreError.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown training format {fmt!r}: use {' or '.join(FORMATS)}")
    if not run_dir.exists():
        raise ConfigError(f"no run directory {str(run_dir)!r}: pass the --run-dir of a run")
    with open_reader(run_dir) as reader:
        _refuse_unfinished(reader)
        rows = [
            r.to_dict() for r in (sft_records(reader) if fmt == "sft" else preference_pairs(reader))
        ]
    path = target(run_dir, fmt, out)
    if path.exists() and not force:
        raise ConfigError(f"{str(path)!r} exists: pass --force to replace it, or another --out")
    _write_jsonl(path, rows)
    return path


def target(run_dir: Path, fmt: str, out: Path | None) -> Path:
    """The file to write: ``out`` when it names a ``.jsonl`` file, else ``<fmt>.jsonl`` in the
    folder ``out`` (default ``RUN_DIR/export``)."""
    if out is not None and out.suffix == ".jsonl" and not out.is_dir():
        return out
    return (out or run_dir / "export") / f"{fmt}.jsonl"


def _refuse_unfinished(reader: RunReader) -> None:
    """A run still in play, or one that stopped before its tasks finished, has trials that are
    not played yet: its data would change. A budget or deadline stop is the end it asked for."""
    state = reader.run_state()
    where = str(reader.run_dir)
    if state.status is RunStatus.RUNNING:
        raise ConfigError(f"run {where!r} is still running: export it once it has finished")
    if state.status not in (RunStatus.COMPLETE, RunStatus.STOPPED):
        raise ConfigError(
            f"run {where!r} is unfinished ({state.status.value}, {state.finished} of "
            f"{state.tasks} tasks done): reflexsim run --resume {where} plays the rest"
        )


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """All rows or nothing: written beside ``path``, then moved over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, rows)
    except OSError as exc:
        raise unwritable(path.parent, exc) from None
