"""Reflexion around the actor: the prompt prefix with memory, self-reflection, the judge.

Which arm keeps what between trials is its memory policy's (:mod:`agents.memory_policy`): it
calls :func:`reflect` on a failed episode (:func:`episodic_memory` for the ``epm`` control: the
failed trajectory, trimmed, instead of a reflection on it), and the trial loop calls
:func:`judge` for the LLM evaluator arm; they take records and return records.

Reflection formats: ``free`` (one paragraph, as in the paper) and ``critique`` (a JSON object
``{missing, superfluous, plan}`` checked against :data:`CRITIQUE_SCHEMA`; text that does not
parse is kept as free text and the parse error is recorded). ``reflection_max_chars`` caps the
text kept; every memory item comes with a :class:`~memory.records.ReflectionNote` saying how it
was made.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agents.episode import ModelPort
from agents.experience import Shown, rules_block
from agents.explore import extract_facts
from agents.layout import REACT, FailedEpisode, PromptLayout, ReflectionAsk
from agents.llm.base import CallSite, GenerationConfig, Request
from agents.prompting import (
    actor_prefix,
    example_texts,
    judge_prompt,
    parse_judge,
    reflection_prompt,
    render_transcript,
    sha256,
    template,
    transcript_pairs,
)
from memory.records import ExplorationFact, Reflection, ReflectionNote, Step, StepKind
from memory.window import TaskMemory

if TYPE_CHECKING:  # types only
    from agents.reflexion_code import TrialSummary

# The critique's JSON: what a constrained decoder would enforce, and what parse_critique checks.
CRITIQUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "missing": {"type": "array", "items": {"type": "string"}},
        "superfluous": {"type": "array", "items": {"type": "string"}},
        "plan": {"type": "string", "minLength": 1},
    },
    "required": ["missing", "superfluous", "plan"],
    "additionalProperties": False,
}
NO_ACTIONS = "(no actions)"
# One paragraph, as in the examples. A new line that starts with ">" is the model writing
# transcript again, not a plan: it ends the reflection too (small models otherwise repeat one
# "> ..." line until the token cap).
REFLECTION_STOPS = ("\n\n", "\n>")
NO_REFLECTION = "(the model wrote no reflection)"


@dataclass(frozen=True)
class ReflexionSettings:
    """How a failed attempt is reflected on, and how much memory the actor is shown."""

    memory_size: int  # Ω: reflections shown to the actor
    reflect_model: str  # recorded as the reflection's provenance
    reflect_max_tokens: int = 256
    prompts: str | None = None  # the examples file (None: the packaged examples)
    seed: int | None = 0
    reflection_format: str = "free"  # free | critique
    reflection_max_chars: int | None = None  # cap on the text kept (None: no cap)
    layout: PromptLayout = REACT  # how the prefix and the reflection prompt are laid out
    instruction: str | None = None  # the actor's instruction text, when a file gave it


@dataclass(frozen=True)
class Reflected:
    """A reflection, what its call cost, and how it was made."""

    reflection: Reflection
    prompt_tokens: int
    completion_tokens: int
    note: ReflectionNote


def visible_reflections(
    reflections: Sequence[Reflection], task: str, before_trial: int, size: int
) -> list[Reflection]:
    """The reflections of ``task`` written before ``before_trial`` that the window shows."""
    memory = TaskMemory(task=task, size=size)
    for r in sorted(reflections, key=lambda r: r.trial):
        if r.task == task and r.trial < before_trial:
            memory.add(r)
    return memory.visible()


def exploration_facts(
    earlier: Sequence[tuple[int, Sequence[Step]]], task: str
) -> list[ExplorationFact]:
    """What earlier trials (``(trial, steps)`` pairs, oldest first) saw in each place."""
    memory = TaskMemory(task=task)
    for trial, steps in earlier:
        for fact in extract_facts(steps, trial):
            memory.observe(fact)
    return memory.known_places()


def prompt_prefix(
    settings: ReflexionSettings,
    task_type: str,
    reflections: Sequence[Reflection] = (),
    facts: Sequence[ExplorationFact] = (),
    experience: Shown = Shown(),
) -> str:
    """The actor's fixed prompt part: examples, then the memory shown (what the arm's memory
    policy recalls: :mod:`agents.memory_policy`); the rules of ``experience`` above it all and
    its retrieved attempts in place of the packaged examples (or before them: ``join``), when the
    policy recalls experience of other tasks."""

    def compose() -> str:
        shots = [r.attempt.text() for r in experience.retrieved]
        if not shots or experience.join:  # the packaged examples, after any retrieved
            shots += example_texts(task_type, settings.prompts)
        return actor_prefix(shots, reflections, facts, settings.instruction)

    texts = [r.text for r in reflections]
    return rules_block(experience.rules) + settings.layout.prefix(task_type, texts, compose)


def cap_text(text: str, max_chars: int | None) -> tuple[str, int | None]:
    """``text`` cut to ``max_chars`` (ending in an ellipsis), and its length before the cut
    (None when it was not cut)."""
    if max_chars is None or len(text) <= max_chars:
        return text, None
    return text[: max(max_chars - 1, 0)].rstrip() + "…", len(text)


def parse_critique(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The critique object in ``text`` checked against :data:`CRITIQUE_SCHEMA`, or None and
    why it was refused."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None, "no JSON object in the text"
    try:
        data = json.loads(text[start : end + 1])
    except ValueError as exc:
        return None, f"invalid JSON: {exc}"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    keys = set(CRITIQUE_SCHEMA["properties"])
    if set(data) != keys:
        return None, f"keys must be exactly {sorted(keys)}, got {sorted(data)}"
    for key in ("missing", "superfluous"):
        if not isinstance(data[key], list) or not all(isinstance(x, str) for x in data[key]):
            return None, f"{key!r} must be a list of strings"
    if not isinstance(data["plan"], str) or not data["plan"].strip():
        return None, "'plan' must be a non-empty string"
    return data, None


def render_critique(critique: dict[str, Any]) -> str:
    """The memory text of a parsed critique."""

    def items(xs: Sequence[str]) -> str:
        return "; ".join(x.strip() for x in xs if x.strip()) or "nothing"

    return (
        f"Missing: {items(critique['missing'])}. Superfluous: {items(critique['superfluous'])}."
        f" Plan: {critique['plan'].strip()}"
    )


async def reflect(
    model: ModelPort,
    settings: ReflexionSettings,
    *,
    task: str,
    trial: int,
    episode_id: str,
    observation: str,
    steps: Sequence[Step],
    past: Sequence[Reflection] = (),
    summary: TrialSummary | None = None,
) -> Reflected:
    """A self-reflection on a failed episode, in the settings' format and length cap.

    The settings' layout lays the prompt out (``past``: the window of this task's earlier
    reflections; ``summary``: the trial's counts, when the layout reads them); the paper's
    code's stops the text only at ``reflect_max_tokens`` and keeps it as the model wrote it.

    Greedy, at most ``reflect_max_tokens`` tokens. Raises the backend's error
    if the call fails (the trial loop retries it later: a reflection is never silently dropped). The ``critique``
    request carries no decoding constraint: the request interface has none for JSON yet, so the
    schema is checked after the fact.
    """
    history = transcript_pairs(steps)

    def compose() -> ReflectionAsk:
        if settings.reflection_format == "critique":
            text = template("reflection_critique").format(
                transcript=render_transcript(observation, history)
            )
            return ReflectionAsk(text, ("\n\n",), keep="critique")
        return ReflectionAsk(reflection_prompt(observation, history), REFLECTION_STOPS)

    on = FailedEpisode(observation, steps, [r.text for r in past], summary)
    ask = settings.layout.reflection(on, compose)
    prompt, stop, critique = ask.prompt, ask.stop, ask.keep == "critique"
    config = GenerationConfig(
        temperature=0.0, max_tokens=settings.reflect_max_tokens, stop=stop, seed=settings.seed
    )
    request = Request(
        config=config,
        prompt=prompt,
        purpose="reflect",
        site=CallSite(
            episode=episode_id,
            game=task,
            trial=trial,
            history=tuple(a for a, _ in history),
            reflection_format=settings.reflection_format,
        ),
    )
    completion = await model.generate(request)
    raw = completion.text.strip()
    text, error = raw or NO_REFLECTION, None
    if ask.keep == "as-written":
        text = completion.text  # the code keeps it as it is (stripped only where it is shown)
    if critique:
        parsed, error = parse_critique(raw)
        if parsed is not None:
            text = render_critique(parsed)
    text, cut_from = cap_text(text, settings.reflection_max_chars)
    reflection = Reflection(
        task=task,
        trial=trial,
        episode_id=episode_id,
        model=settings.reflect_model,
        prompt_hash=sha256(prompt),
        text=text,
    )
    note = ReflectionNote(
        task=task,
        trial=trial,
        format=settings.reflection_format,
        chars=len(text),
        truncated_from=cut_from,
        parse_error=error,
        raw=completion.text,
    )
    return Reflected(reflection, completion.prompt_tokens, completion.completion_tokens, note)


def trimmed_trajectory(steps: Sequence[Step]) -> str:
    """A failed episode as the ``epm`` arm keeps it: its actions and their observations."""
    acts = [(s.action, s.observation) for s in steps if s.kind == StepKind.ACT]
    return "\n".join(f"> {a}\n{o}" for a, o in acts) or NO_ACTIONS


def episodic_memory(
    settings: ReflexionSettings, *, task: str, trial: int, episode_id: str, steps: Sequence[Step]
) -> tuple[Reflection, ReflectionNote]:
    """The ``epm`` memory item of a failed episode: its trimmed trajectory (no model call)."""
    full = trimmed_trajectory(steps)
    text, cut_from = cap_text(full, settings.reflection_max_chars)
    reflection = Reflection(
        task=task, trial=trial, episode_id=episode_id, model="epm", prompt_hash=sha256(full),
        text=text,
    )  # fmt: skip
    note = ReflectionNote(
        task=task, trial=trial, format="epm", chars=len(text), truncated_from=cut_from, raw=""
    )
    return reflection, note


async def judge(
    model: ModelPort,
    *,
    task: str,
    trial: int,
    observation: str,
    steps: Sequence[Step],
    seed: int | None = 0,
    episode_id: str | None = None,
) -> tuple[str, str]:
    """The LLM evaluator's verdict on a finished episode: ('success'|'failure'|'unclear',
    reason). Recorded next to the env's truth, never replacing it."""
    history = transcript_pairs(steps)
    request = Request(
        config=GenerationConfig(temperature=0.0, max_tokens=64, stop=("\n",), seed=seed),
        prompt=judge_prompt(observation, history),
        purpose="judge",
        site=CallSite(
            episode=episode_id, game=task, trial=trial, history=tuple(a for a, _ in history)
        ),
    )
    completion = await model.generate(request)
    return parse_judge(completion.text)
