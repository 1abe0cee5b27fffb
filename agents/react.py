"""The ReAct actor: a completion-style few-shot prompt, one action per model call.

The prompt is append-only (``prefix`` + transcript + ``"\\n>"``), so a prefix cache reuses it
from step to step. A ``think:`` line is a thought (observation ``OK.``, the env is not asked); an
empty line is an invalid step ("Nothing happens."); anything else is an action sent to the env
after the grounding rules. The episode ends when the env says won, when the evaluator gives a
failure verdict, or at the step cap. The prompt's layout and how a step is taken are the
actor's layout's (:mod:`agents.layout`): ReAct's own here, the paper's code's in
:mod:`agents.reflexion_code` (no parsing or grounding, short outputs asked again, every action
sent to the env).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from agents.arm import Arm, ArmContext
from agents.episode import EpisodeContext, EpisodeEnd
from agents.evaluators import Evaluator, Verdict, classify_failure, count_actions
from agents.layout import REACT, PromptLayout
from agents.llm.base import ActionConstraint, CallSite, Completion, GenerationConfig, Request
from agents.llm.grounding import nearest_action
from agents.memory_policy import EPISODIC, EXPLORATION, NO_MEMORY, REFLEXION
from agents.parsing import GroundingRules, ParsedAction, parse_action
from agents.prompting import transcript_pairs
from memory.records import EnvReply, Step, StepKind

NOTHING_HAPPENS = "Nothing happens."
THOUGHT_OBSERVATION = "OK."


@dataclass(frozen=True)
class ActorSettings:
    """How the actor samples, parses and when its episode ends."""

    generation: GenerationConfig
    evaluator: Evaluator
    grounding: GroundingRules
    max_steps: int
    count_thoughts: bool = True
    action_decoding: str = "free"  # free | grounded | nearest (the config's action_decoding)
    layout: PromptLayout = REACT  # the prompt's layout and how a step is taken


def actor_request(
    settings: ActorSettings,
    ctx_spec_prefix: str,
    observation: str,
    steps: Sequence[Step],
    state: EnvReply,
    *,
    game: str,
    trial: int,
    seed: int | None,
    episode: str | None = None,
) -> Request:
    """The request for the next step. Its call site is for routing, seeds and scripted
    policies (a real model never sees it)."""
    history = transcript_pairs(steps)
    return Request(
        config=replace(settings.generation, seed=seed),
        prompt=settings.layout.actor_prompt(ctx_spec_prefix, observation, steps),
        purpose="act",
        constraint=ActionConstraint(state.admissible)
        if settings.action_decoding == "grounded"
        else None,
        site=CallSite(
            episode=episode,
            game=game,
            trial=trial,
            step=len(steps),
            history=tuple(a for a, _ in history),
            admissible=tuple(state.admissible),
        ),
    )


def make_step(
    index: int,
    parsed: ParsedAction,
    completion: Completion,
    observation: str,
    admissible: bool,
    reply: EnvReply | None = None,
) -> Step:
    return Step(
        index=index,
        kind=parsed.kind.value,
        raw_output=completion.text,
        action=parsed.action,
        observation=observation,
        admissible=admissible,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        cached_tokens=completion.cached_tokens,
        latency_s=completion.latency_s,
        reward=reply.reward if reply else 0.0,
        won=bool(reply and reply.won),
    )


class Actor:
    """The actor's steps, shared by every agent that acts as ReAct does (ReAct itself,
    Plan-and-Execute, LATS): start an episode, take one step, parse the model's text, and say
    when the episode is over. It plays no episode: its agents do."""

    def __init__(self, settings: ActorSettings) -> None:
        self.settings = settings

    async def start(self, ctx: EpisodeContext) -> tuple[EnvReply, str, list[Step], bool]:
        """Reset (re-simulating a resumed episode's actions): the state, the first observation,
        the steps so far, and whether the env truncated the episode."""
        spec = ctx.spec
        state = await ctx.reset(spec.replay_actions())
        observation = spec.resumed_observation if spec.resumed else state.observation
        assert observation is not None
        steps = list(spec.resume_steps)
        return state, observation, steps, state.truncated if steps else False

    async def next_step(
        self, ctx: EpisodeContext, observation: str, steps: Sequence[Step], state: EnvReply
    ) -> tuple[Step, EnvReply, bool]:
        """One step, as the layout takes it. The step, the state after it, and whether the env
        truncated the episode."""
        spec = ctx.spec
        request = actor_request(
            self.settings, spec.prefix, observation, steps, state,
            game=spec.game, trial=spec.trial, seed=spec.seed, episode=spec.episode_id,
        )  # fmt: skip
        return await self.settings.layout.act(self, ctx, request, state, len(steps))

    async def react_step(
        self, ctx: EpisodeContext, request: Request, state: EnvReply, index: int
    ) -> tuple[Step, EnvReply, bool]:
        """ReAct's step: ask the model, parse, and send an action to the env."""
        completion = await ctx.generate(request)
        parsed = self.parse(completion.text, state.admissible)
        if parsed.kind == StepKind.ACT:
            admissible = parsed.action in state.admissible
            state = await ctx.step(parsed.action)
            step = make_step(index, parsed, completion, state.observation, admissible, state)
            return step, state, state.truncated
        thought = parsed.kind == StepKind.THINK
        obs = THOUGHT_OBSERVATION if thought else NOTHING_HAPPENS
        return make_step(index, parsed, completion, obs, thought), state, False

    def parse(self, text: str, admissible: Sequence[str]) -> ParsedAction:
        """The model's text as a step; with ``nearest`` decoding an action that is not admissible
        is replaced by the most similar admissible command (``agents.llm.grounding``)."""
        parsed = parse_action(text, self.settings.grounding)
        if self.settings.action_decoding != "nearest" or parsed.kind == StepKind.THINK:
            return parsed
        if parsed.kind == StepKind.ACT and parsed.action in admissible:
            return parsed

        mapped = nearest_action(parsed.action or text, admissible)
        again = parse_action(mapped, GroundingRules.none())
        return ParsedAction(again.kind, text, again.action, (*parsed.rules, "nearest"))

    def check_end(self, steps: Sequence[Step], truncated: bool) -> EpisodeEnd | None:
        """The end of the episode after ``steps``, or None to go on."""
        if not steps:
            return None
        if steps[-1].won:
            return EpisodeEnd(won=True)
        verdict: Verdict | None = self.settings.evaluator.check(steps)
        capped = truncated or (
            count_actions(steps, self.settings.count_thoughts) >= self.settings.max_steps
        )
        if verdict is None and not capped:
            return None
        return EpisodeEnd(
            won=False,
            failure_class=classify_failure(steps, verdict, capped),
            verdict=verdict.reason if verdict else "step cap",
        )


class ReActAgent(Actor):
    """Plays one episode; see the module docstring."""

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        state, observation, steps, truncated = await self.start(ctx)
        while True:
            end = self.check_end(steps, truncated)
            if end is not None:
                return end
            step, state, truncated = await self.next_step(ctx, observation, steps, state)
            steps.append(step)
            ctx.record(step)


def build_react(ctx: ArmContext) -> ReActAgent:
    return ReActAgent(ctx.actor)


# ReAct, alone or with memory between trials (the reflexion-code protocol plays the first two)
ARMS = (
    Arm(
        "react",
        build_react,
        NO_MEMORY,
        "the resampling baseline: each trial afresh",
        code_protocol=True,
    ),
    Arm("reflexion", build_react, REFLEXION, "self-reflections kept per task", code_protocol=True),
    Arm("reflexion+explore", build_react, EXPLORATION, "reflections and what earlier trials found"),
    Arm("epm", build_react, EPISODIC, "the last failed trajectories instead of reflections"),
)
