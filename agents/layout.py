"""How an arm's prompts are laid out: the one interface every prompt goes through.

A layout builds the actor's prompt at each step, the fixed part before the first observation,
and the reflection request; it also says how a step is taken (ReAct parses the model's text, the
paper's code sends it as it is) and how the trial loop treats reflections. :class:`PromptLayout`
is ReAct's own layout (reflexsim's protocol); the paper's code's is
:class:`agents.reflexion_code.CodeLayout`, in its own module. An arm with a layout of its own
subclasses one of them and gives it to its actor (``replace(ctx.actor, layout=...)`` in its
factory): the request is recorded as sent, so the viewer, replay and export show it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from agents.prompting import actor_prompt, transcript_pairs
from memory.records import EnvReply, Step

if TYPE_CHECKING:  # types only
    from agents.episode import EpisodeContext
    from agents.llm.base import Request
    from agents.reflexion_code import TrialSummary


class StepTaker(Protocol):
    """The actor's own step (ask, parse, act): what ReAct's layout takes a step with."""

    async def react_step(
        self, ctx: EpisodeContext, request: Request, state: EnvReply, index: int
    ) -> tuple[Step, EnvReply, bool]: ...


@dataclass(frozen=True)
class FailedEpisode:
    """What a reflection is written on: the failed episode's first observation and steps, the
    window of the task's earlier reflections, and the trial's counts (when the layout reads
    them)."""

    observation: str
    steps: Sequence[Step]
    past: Sequence[str] = ()
    summary: TrialSummary | None = None


@dataclass(frozen=True)
class ReflectionAsk:
    """A reflection request's text, its stop strings, and how its answer is kept: ``free``
    (stripped), ``critique`` (a JSON critique, rendered) or ``as-written``."""

    prompt: str
    stop: tuple[str, ...]
    keep: str = "free"


class PromptLayout:
    """ReAct's layout: the prompt is ``prefix`` + the transcript + ``"\\n>"``, the fixed part is
    what the arm's memory composes (examples, memory, rules), the model's text is parsed into a
    step, and no reflection is written after a run's last trial (it would never be read)."""

    name = "reflexsim"
    reflects_after_last_trial = False
    reads_trial_summary = False  # whether a reflection reads the task's earlier reflections and
    # the trial's counts (the trial loop then waits for them)
    chat_instruction: str | None = None  # what a chat model is sent before the prompt (None: the
    # backend's own)

    @staticmethod
    def actor_prompt(prefix: str, observation: str, steps: Sequence[Step]) -> str:
        """The actor prompt after ``steps`` (what the model answers the next step to). Static:
        a recorded run's step prompts are rebuilt from its layout's class, with none of its
        files (a layout that overrides it must stay so to be rebuilt)."""
        return actor_prompt(prefix, observation, transcript_pairs(steps))

    async def act(
        self, actor: StepTaker, ctx: EpisodeContext, request: Request, state: EnvReply, index: int
    ) -> tuple[Step, EnvReply, bool]:
        """One step from ``request``: the step, the state after it, and whether the env
        truncated the episode."""
        return await actor.react_step(ctx, request, state, index)

    def prefix(self, task_type: str, reflections: Sequence[str], compose: Callable[[], str]) -> str:
        """The fixed part before the first observation (``compose``: the memory policy's)."""
        return compose()

    def reflection(self, on: FailedEpisode, compose: Callable[[], ReflectionAsk]) -> ReflectionAsk:
        """The reflection request on a failed episode (``compose``: the reflection format's
        own request)."""
        return compose()


REACT = PromptLayout()
