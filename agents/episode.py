"""What an agent plays with and what it returns: the episode context and its records.

An agent plays one episode as a coroutine over a context it is handed: ``await ctx.reset()``,
``await ctx.step(action)``, ``await ctx.generate(request)``, and ``ctx.record(step)`` for every
step it wants kept. It never sees SQLite, worker processes or HTTP: the engine behind the context
stores each recorded step the moment it is recorded, batches model requests across episodes,
re-simulates an episode whose env worker died, and turns a request that failed after its retries
into an infrastructure error of this episode alone (the exception simply leaves ``play``).

Coroutines rather than explicit state machines: an agent reads top to bottom as the loop it is
(ReAct is a dozen lines; search agents keep their tree in local variables), and asyncio gives
the engine every in-flight episode's pending call without a lockstep tick.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agents.experience import Shown
from agents.llm.base import Completion, Request
from memory.records import EnvReply, Reflection, Step, env_actions


def episode_seed(run_seed: int, game: str, trial: int) -> int:
    """The sampling seed of one episode: a stable function of (run seed, game, trial), so each
    trial of a task draws different samples and the same run seed draws the same ones. The same
    samples make the same run only where the backend's logits for a prompt do not depend on
    what else it serves (README: "When a run replays")."""
    digest = hashlib.sha256(f"{run_seed}|{game}|{trial}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: a task in a trial, with the fixed part of its prompt.

    A resumed episode carries its recorded steps and first observation: the agent continues from
    its next step after the engine has re-simulated the recorded actions.
    """

    episode_id: str
    game: str
    task_type: str
    trial: int
    prefix: str  # instruction + examples + memory block
    memory: tuple[Reflection, ...] = ()
    seed: int | None = 0  # the sampling seed of this episode's actor requests
    resume_steps: tuple[Step, ...] = ()
    resumed_observation: str | None = None  # the recorded first observation, when resumed
    # the experience of other games the prefix shows (None: the run was given none)
    experience: Shown | None = None
    # the prefix and its experience from the first observation, when they depend on the task
    # (set on first reset)
    prefix_for: Callable[[str], tuple[str, Shown | None]] | None = None

    @property
    def resumed(self) -> bool:
        return self.resumed_observation is not None

    def replay_actions(self) -> tuple[str, ...]:
        """The env actions of the recorded steps (thoughts and invalid outputs never reach it)."""
        return env_actions(self.resume_steps)


@dataclass(frozen=True)
class EpisodeEnd:
    """How an episode the agent played to its end came out (success is the env's ``won``)."""

    won: bool
    failure_class: str | None = None
    verdict: str | None = None  # why the evaluator (or the step cap) ended it


class ModelPort(Protocol):
    """Model access for an agent's calls that are not episode steps (reflect, judge, plan)."""

    async def generate(self, request: Request) -> Completion: ...


class EpisodeContext(ModelPort, Protocol):
    """The two calls an agent plays through (plus reset and record). See the module docstring."""

    spec: EpisodeSpec

    async def reset(self, replay: Sequence[str] = ()) -> EnvReply:
        """Start the episode's game, then re-simulate ``replay``; the state after them."""
        ...

    async def step(self, action: str) -> EnvReply:
        """One env step. Thoughts and invalid outputs are never sent here."""
        ...

    def record(self, step: Step) -> None:
        """Keep a step: the engine commits it to the run store now."""
        ...


class Agent(Protocol):
    """Plays one episode through a context and says how it ended."""

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd: ...
