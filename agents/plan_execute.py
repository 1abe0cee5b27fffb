"""Plan-and-Execute: a planner writes a numbered plan, the ReAct actor executes it, and after a
failure signal a replanner rewrites the steps that remain.

The plan is recorded as a thought step (``think: Plan: 1) ...; 2) ...``, answered ``OK.``), so
the actor reads it in its own transcript and the prompt stays append-only (prefix-cacheable);
a replan is another such step (``think: Revised plan for the remaining steps: ...``). Plan steps
are thoughts: with ``count_thoughts`` they use up the step budget like any thought.

Failure signals: the evaluator's loop verdict (the same action and observation over and over;
not the action cap, which no plan can undo), or ``replan_after_nothing`` "Nothing happens."
answers in a row. Each calls the replanner, at most ``max_replans`` times; after that the
evaluator ends the episode as it would a ReAct episode. Plan calls are ``purpose="plan"``: the
engine sends them to the planner model (default: the actor's).

The arms' options are the ``planning`` config section (:class:`PlanningConfig`), which is also the
agent's settings.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from agents.arm import Arm, ArmContext, ModelRole
from agents.episode import EpisodeContext, EpisodeEnd
from agents.evaluators import count_actions
from agents.llm.base import CallSite, Completion, GenerationConfig, Request
from agents.llm.markers import NO_PLAN, PLAN_PREFIX, REPLAN_PREFIX, render_plan
from agents.memory_policy import NO_MEMORY, REFLEXION
from agents.options import model_spec, option
from agents.parsing import ParsedAction
from agents.prompting import example_texts, render_transcript, template, transcript_pairs
from agents.react import NOTHING_HAPPENS, THOUGHT_OBSERVATION, Actor, ActorSettings, make_step
from memory.records import EnvReply, FailureClass, Step, StepKind

PLAN_STOPS = ("\n\n",)
MAX_PLAN_STEPS = 30  # plan items kept at most
_ITEM = re.compile(r"^\s*(?:\d+\s*[.):]|[-*•])\s*(?P<text>.+?)\s*$")


@dataclass(frozen=True)
class PlanningConfig:
    """Plan-and-Execute (agents plan, plan+reflexion): plan, execute with ReAct, replan."""

    planner_model: str | None = option(
        None, "model spec of the planner and replanner (default: the actor's)", check=model_spec
    )
    max_replans: int = option(2, "replans per episode at most", minimum=0)
    replan_after_nothing: int = option(
        3, 'answers of "Nothing happens." in a row that call the replanner', minimum=1
    )
    plan_max_tokens: int = option(256, "tokens per plan at most", minimum=1)


def parse_plan(text: str, limit: int = MAX_PLAN_STEPS) -> list[str]:
    """The actions of a numbered (or bulleted) list, in order; the first line when the text
    has no list. Model text is untrusted: never raises."""
    items = []
    for line in text.splitlines():
        m = _ITEM.match(line)
        if m:
            items.append(m.group("text").lstrip("> ").strip())
    if not items:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        items = [first] if first else []
    return [" ".join(i.split()) for i in items if i.strip()][:limit]


def is_plan(step: Step) -> bool:
    return step.kind == StepKind.THINK and step.action.startswith((PLAN_PREFIX, REPLAN_PREFIX))


def plan_example(transcript: str) -> str:
    """A solved example as a plan: its first observation, then its actions numbered."""
    head, _, rest = transcript.partition("\n> ")
    actions = [
        line[2:].strip()
        for line in ("> " + rest).splitlines()
        if line.startswith("> ") and not line[2:].lower().startswith("think:")
    ]
    numbered = "\n".join(f"{i}. {a}" for i, a in enumerate(actions, 1))
    return f"{head.strip()}\nPlan:\n{numbered}"


def planner_prompt(examples: Sequence[str], observation: str) -> str:
    shown = "\n\n".join(plan_example(e) for e in examples)
    return template("plan").format(examples=shown, observation=observation.strip())


def replanner_prompt(
    examples: Sequence[str], observation: str, steps: Sequence[Step], signal: str
) -> str:
    shown = "\n\n".join(plan_example(e) for e in examples)
    plans = [s for s in steps if is_plan(s)]
    current = plans[-1].action.split(": ", 2)[-1] if plans else NO_PLAN
    return template("replan").format(
        examples=shown,
        transcript=render_transcript(observation, transcript_pairs(steps)),
        plan=current,
        signal=signal,
    )


class PlanExecuteAgent:
    """Plans, executes with the ReAct actor, replans after a failure signal (module docstring)."""

    def __init__(
        self, actor: ActorSettings, settings: PlanningConfig, prompts: str | None = None
    ) -> None:
        self.actor = Actor(actor)
        self.settings = settings
        self.prompts = prompts  # the examples file the plans are shown from (None: packaged)

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        state, observation, steps, truncated = await self.actor.start(ctx)
        if not any(is_plan(s) for s in steps):
            step = await self.plan(ctx, observation, steps, state, None)
            steps.append(step)
            ctx.record(step)
        while True:
            end = self.actor.check_end(steps, truncated)
            signal = self.failure_signal(steps, end, truncated)
            replans = sum(1 for s in steps if s.action.startswith(REPLAN_PREFIX))
            if signal is not None and replans < self.settings.max_replans:
                step = await self.plan(ctx, observation, steps, state, signal)
                steps.append(step)
                ctx.record(step)
                continue
            if end is not None:
                return end
            step, state, truncated = await self.actor.next_step(ctx, observation, steps, state)
            steps.append(step)
            ctx.record(step)

    def failure_signal(
        self, steps: Sequence[Step], end: EpisodeEnd | None, truncated: bool
    ) -> str | None:
        """Why the plan is not working, or None: a loop verdict of the evaluator, or a streak
        of "Nothing happens." answers. The step cap and the action cap are not signals."""
        settings = self.actor.settings
        if end is not None and end.won:
            return None
        if truncated or count_actions(steps, settings.count_thoughts) >= settings.max_steps:
            return None
        verdict = settings.evaluator.check(steps)
        if verdict is not None:
            loop = verdict.failure_class == FailureClass.REPEATED_ACTION.value
            return verdict.reason if loop else None
        streak = 0
        for s in reversed(steps):
            if s.observation != NOTHING_HAPPENS:
                break
            streak += 1
        if streak >= self.settings.replan_after_nothing:
            return f'{streak} actions in a row answered "{NOTHING_HAPPENS}"'
        return None

    async def plan(
        self,
        ctx: EpisodeContext,
        observation: str,
        steps: Sequence[Step],
        state: EnvReply,
        signal: str | None,
    ) -> Step:
        """The plan step (``signal`` None) or a replan step after ``signal``."""
        spec = ctx.spec
        examples = example_texts(spec.task_type, self.prompts)
        if signal is None:
            prompt = planner_prompt(examples, observation)
        else:
            prompt = replanner_prompt(examples, observation, steps, signal)
        history = transcript_pairs(steps)
        request = Request(
            config=GenerationConfig(
                temperature=0.0, max_tokens=self.settings.plan_max_tokens, stop=PLAN_STOPS,
                seed=spec.seed,
            ),
            prompt=prompt,
            purpose="plan",
            site=CallSite(
                episode=spec.episode_id,
                game=spec.game,
                trial=spec.trial,
                step=len(steps),
                history=tuple(a for a, _ in history),
                admissible=tuple(state.admissible),
                replan=signal is not None,
            ),
        )  # fmt: skip
        completion: Completion = await ctx.generate(request)
        items = parse_plan(completion.text)
        prefix = PLAN_PREFIX if signal is None else REPLAN_PREFIX
        parsed = ParsedAction(StepKind.THINK, completion.text, prefix + render_plan(items))
        return make_step(len(steps), parsed, completion, THOUGHT_OBSERVATION, True)


def _build(ctx: ArmContext) -> PlanExecuteAgent:
    return PlanExecuteAgent(ctx.actor, ctx.settings, ctx.reflexion.prompts)


PLANNER = ModelRole("planner", ("plan",), "planner_model")  # the planner and replanner
ARMS = (
    Arm(
        "plan",
        _build,
        NO_MEMORY,
        "Plan-and-Execute",
        section="planning",
        settings=PlanningConfig,
        roles=(PLANNER,),
    ),
    Arm(
        "plan+reflexion",
        _build,
        REFLEXION,
        "Plan-and-Execute with reflections",
        section="planning",
        settings=PlanningConfig,
        roles=(PLANNER,),
    ),
)
