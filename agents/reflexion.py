"""Reflexion around the ReAct actor: the prompt prefix with memory, self-reflection, the judge.

Arms: ``react`` (the resampling baseline: no memory), ``reflexion`` (the last Ω reflections in
the prompt), ``reflexion+explore`` (also what earlier trials saw in each place). Between trials
the trial loop calls :func:`reflect` on a failed episode (and :func:`judge` for the LLM
evaluator arm); both take records and return records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agents.episode import ModelPort
from agents.explore import extract_facts
from agents.llm.base import GenerationConfig, Request
from agents.prompting import (
    actor_prefix,
    example_texts,
    judge_prompt,
    parse_judge,
    reflection_prompt,
    sha256,
    transcript_pairs,
)
from memory.records import ExplorationFact, Reflection, Step
from memory.window import TaskMemory

ARMS = ("react", "reflexion", "reflexion+explore")
# One paragraph, as in the examples. A new line that starts with ">" is the model writing
# transcript again, not a plan: it ends the reflection too (small models otherwise repeat one
# "> ..." line until the token cap).
REFLECTION_STOPS = ("\n\n", "\n>")
NO_REFLECTION = "(the model wrote no reflection)"


@dataclass(frozen=True)
class ReflexionSettings:
    arm: str
    memory_size: int  # Ω: reflections shown to the actor
    reflect_model: str  # recorded as the reflection's provenance
    reflect_max_tokens: int = 256
    prompts_file: str | None = None
    seed: int | None = 0

    @property
    def uses_memory(self) -> bool:
        return self.arm != "react"


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
) -> str:
    """The actor's fixed prompt part for this arm: examples, then the memory the arm shows."""
    shown = reflections if settings.uses_memory else ()
    seen = facts if settings.arm == "reflexion+explore" else ()
    return actor_prefix(example_texts(task_type, settings.prompts_file), shown, seen)


async def reflect(
    model: ModelPort,
    settings: ReflexionSettings,
    *,
    task: str,
    trial: int,
    episode_id: str,
    observation: str,
    steps: Sequence[Step],
) -> tuple[Reflection, int, int]:
    """A self-reflection on a failed episode, and its (prompt, completion) tokens.

    Greedy, at most ``reflect_max_tokens`` tokens. Raises the backend's error if the call fails
    (the trial loop retries it later: a reflection is never silently dropped).
    """
    prompt = reflection_prompt(observation, transcript_pairs(steps))
    config = GenerationConfig(
        temperature=0.0,
        max_tokens=settings.reflect_max_tokens,
        stop=REFLECTION_STOPS,
        seed=settings.seed,
    )
    request = Request(
        config=config, prompt=prompt, purpose="reflect", side={"game": task, "trial": trial}
    )
    completion = await model.generate(request)
    reflection = Reflection(
        task=task,
        trial=trial,
        episode_id=episode_id,
        model=settings.reflect_model,
        prompt_hash=sha256(prompt),
        text=completion.text.strip() or NO_REFLECTION,
    )
    return reflection, completion.prompt_tokens, completion.completion_tokens


async def judge(
    model: ModelPort,
    *,
    task: str,
    trial: int,
    observation: str,
    steps: Sequence[Step],
    seed: int | None = 0,
) -> tuple[str, str]:
    """The LLM evaluator's verdict on a finished episode: ('success'|'failure'|'unclear',
    reason). Recorded next to the env's truth, never replacing it."""
    history = transcript_pairs(steps)
    request = Request(
        config=GenerationConfig(temperature=0.0, max_tokens=64, stop=("\n",), seed=seed),
        prompt=judge_prompt(observation, history),
        purpose="judge",
        side={"game": task, "trial": trial, "history": [a for a, _ in history]},
    )
    completion = await model.generate(request)
    return parse_judge(completion.text)
