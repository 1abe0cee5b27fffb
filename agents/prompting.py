"""Pure functions that build prompts from records and template files.

The actor prompt is append-only within an episode: ``prefix`` (instruction, two examples,
memory) never changes, and each step appends ``"> action\\nobservation\\n>"``, so a prefix cache
reuses nearly all of it from one step to the next.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from memory.records import ExplorationFact, Reflection, Step

TASK_TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")


@cache
def template(name: str) -> str:
    """A prompt template shipped as package data (``agents/prompts/<name>.txt``)."""
    return resources.files("agents.prompts").joinpath(f"{name}.txt").read_text()


def template_hashes() -> dict[str, str]:
    """sha256 of every template and example file, for the run manifest."""
    root = resources.files("agents.prompts")
    out: dict[str, str] = {}
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".txt"):
            out[entry.name] = sha256(entry.read_text())
    examples = root.joinpath("examples")
    for entry in sorted(examples.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".json"):
            out[f"examples/{entry.name}"] = sha256(entry.read_text())
    return out


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (what a manifest records of a file the run read)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class Example:
    """A solved transcript: the first observation and the (action, observation) pairs."""

    game: str
    observation: str
    steps: tuple[tuple[str, str], ...]

    def text(self) -> str:
        return render_transcript(self.observation, self.steps)


def transcript_action(step: Step) -> str:
    """The action text a transcript shows for a step: what was executed (or the thought), else
    the model's own text (an invalid step). The one rule, used by every prompt and viewer."""
    return step.action or step.raw_output.strip()


def transcript_pairs(steps: Sequence[Step]) -> list[tuple[str, str]]:
    """(action text, observation) of each step, as every transcript renders them."""
    return [(transcript_action(s), s.observation) for s in steps]


def render_transcript(observation: str, steps: Sequence[tuple[str, str]]) -> str:
    parts = [observation]
    for action, obs in steps:
        parts.append(f"\n> {action}\n{obs}")
    return "".join(parts)


@cache
def _packaged_examples(name: str) -> dict[str, tuple[Example, ...]]:
    raw = json.loads(
        resources.files("agents.prompts").joinpath("examples", f"{name}.json").read_text()
    )
    return {
        kind: tuple(
            Example(
                e["game"],
                e["observation"],
                tuple((s["action"], s["observation"]) for s in e["steps"]),
            )
            for e in items
        )
        for kind, items in raw.items()
    }


class PromptFileError(ValueError):
    """A ``--prompts`` file that cannot be used; the message names the file and the fix."""


class NotAFileError(OSError):
    """A path the user named that is no regular file (a FIFO, a socket, a device)."""


def read_user_text(path: str | Path) -> str:
    """The UTF-8 text of a file the user named. Only a regular file (or a folder, whose read
    raises IsADirectoryError) is opened: a FIFO or a device would wait for a writer, or never
    end; it raises :class:`NotAFileError` naming the path."""
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None  # the read below raises what says why (missing, not allowed)
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise NotAFileError(
            errno.EINVAL,
            "not a regular file (a pipe, a socket or a device): pass a file",
            str(path),
        )
    return Path(path).read_text(encoding="utf-8")


def example_texts(task_type: str, prompts_file: str | Path | None = None) -> tuple[str, str]:
    """The two example transcripts for a task type, from the package or an original prompt file."""
    if prompts_file is not None:
        return load_original_prompts(prompts_file, (task_type,))[task_type]
    family = "textworld" if task_type == "textworld" else "alfworld"
    examples = _packaged_examples(family).get(task_type)
    if not examples or len(examples) < 2:
        raise ValueError(f"no few-shot examples for task type {task_type!r}")
    return examples[0].text(), examples[1].text()


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_kind(value: object) -> str:
    return "null" if value is None else _JSON_KINDS.get(type(value), "object")


_FORMAT = "a JSON object of react_<type>_0 and react_<type>_1 transcripts (strings)"


def load_original_prompts(
    path: str | Path, task_types: Sequence[str] = (), verbatim: bool = False
) -> dict[str, tuple[str, str]]:
    """Read the original ReAct prompt-file format: a JSON of ``react_<type>_<k>`` transcripts.

    Returns, per task type, the two transcripts in the order the original Reflexion code used
    (``_1`` then ``_0``): byte for byte with ``verbatim``, else without their leading and
    trailing newlines (reflexsim's layout adds its own). A file that cannot be used (missing,
    a folder, not text, not JSON, not an object, a transcript that is not a string, no pair for
    one of ``task_types``) raises :class:`PromptFileError` naming the fix.
    """
    where = f"prompt file {str(path)!r}"
    try:
        data = json.loads(read_user_text(path))
    except FileNotFoundError:
        raise PromptFileError(f"{where} does not exist: pass the path of {_FORMAT}") from None
    except IsADirectoryError:
        raise PromptFileError(f"{where} is a folder: pass the path of {_FORMAT}") from None
    except UnicodeDecodeError:
        raise PromptFileError(f"{where} is not text: pass {_FORMAT}") from None
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            f"{where} is not valid JSON ({exc.msg} at line {exc.lineno}): pass {_FORMAT}"
        ) from None
    except OSError as exc:
        raise PromptFileError(f"cannot read {where} ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise PromptFileError(f"{where} holds a JSON {_json_kind(data)}: it must be {_FORMAT}")
    found: dict[str, dict[int, str]] = {}
    for key, value in data.items():
        m = re.fullmatch(r"react_(\w+?)_(\d+)", key)
        if not m:
            continue
        if not isinstance(value, str):
            raise PromptFileError(
                f"{where}: {key} is a JSON {_json_kind(value)}, not a string: "
                "each transcript is one string"
            )
        found.setdefault(m.group(1), {})[int(m.group(2))] = value if verbatim else value.strip("\n")
    out = {k: (v[1], v[0]) for k, v in found.items() if 0 in v and 1 in v}
    if not out:
        raise PromptFileError(f"{where} has no react_<type>_0/_1 pairs: it must be {_FORMAT}")
    missing = [t for t in task_types if t not in out]
    if missing:
        pairs = ", ".join(f"react_{t}_0/_1" for t in missing)
        raise PromptFileError(
            f"{where} has no {pairs} (the run plays {', '.join(missing)} games): add them, "
            "or leave out --prompts for the packaged examples"
        )
    return out


def memory_block(reflections: Sequence[Reflection], facts: Sequence[ExplorationFact] = ()) -> str:
    """The memory section shown between the examples and the task; '' when empty."""
    parts: list[str] = []
    if reflections:
        items = "".join(
            template("memory_item").format(trial=r.trial, text=r.text.strip()) for r in reflections
        )
        parts.append(template("memory_block").format(reflections=items.rstrip("\n")))
    if facts:
        parts.append(template("explore_block").format(facts=render_facts(facts)))
    return "".join(parts)


def render_facts(facts: Sequence[ExplorationFact]) -> str:
    lines = []
    for f in facts:
        seen = ", ".join(f.contents) if f.contents else "nothing"
        lines.append(f"- {f.place}: {seen}")
    return "\n".join(lines)


def actor_prefix(
    examples: Sequence[str],
    reflections: Sequence[Reflection] = (),
    facts: Sequence[ExplorationFact] = (),
    instruction: str | None = None,
) -> str:
    """Instruction (the packaged one unless given), the examples, the memory block, then the
    task header."""
    body = "\n\n".join(e.strip("\n") for e in examples)
    return (
        (template("react_instruction") if instruction is None else instruction)
        + body
        + "\n\n"
        + memory_block(reflections, facts)
        + template("task_header")
    )


def actor_prompt(prefix: str, observation: str, history: Sequence[tuple[str, str]]) -> str:
    """The whole prompt of the next step. Ends with '>' (a trailing space derails small models)."""
    return prefix + render_transcript(observation, history) + "\n>"


def reflection_prompt(observation: str, history: Sequence[tuple[str, str]]) -> str:
    """The reflection prompt; it ends where the model writes (the file's last newline dropped)."""
    return (
        template("reflection")
        .format(
            examples=template("reflection_examples").strip("\n"),
            transcript=render_transcript(observation, history),
        )
        .removesuffix("\n")
    )


def judge_prompt(observation: str, history: Sequence[tuple[str, str]]) -> str:
    return template("judge").format(transcript=render_transcript(observation, history))


def parse_judge(text: str) -> tuple[str, str]:
    """('success' | 'failure' | 'unclear', reason) from a judge's free text."""
    stripped = text.strip()
    head = stripped.split(None, 1)[0].strip(".:,").upper() if stripped else ""
    reason = stripped[len(head) :].strip(" .:-") if head else ""
    if head == "SUCCESS":
        return "success", reason
    if head == "FAILURE":
        return "failure", reason
    return "unclear", stripped[:200]
