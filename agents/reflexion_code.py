"""The ``reflexion-code`` protocol: the prompts and action handling of the paper's code, exactly.

The Reflexion paper's ALFWorld code (noahshinn/reflexion, ``alfworld_runs/``) lays its prompts
out by a handful of string rules; this module applies the same rules to the wording the user
gives (nothing of the original wording ships here):

- actor prompt: the instruction file verbatim, then the examples ``react_<type>_1`` and
  ``react_<type>_0`` of the prompt file verbatim (no separator), then the memory block (only when
  there is memory: the last Ω reflections, numbered by position ``0, 1, 2``, each stripped), then
  the task header and the first observation; each step appends ``"\\n> action"`` and
  ``"\\nobservation"``, and the prompt is that text with ``">"`` appended (so after the first
  step it ends ``"observation>"``);
- the action is the model's text stripped of surrounding space, nothing else; an output shorter
  than 5 characters (stripped) is asked again at temperature +0.2 per try, six tries in all, then
  the empty action is played; every action reaches the env, and one that starts with ``think:``
  is then shown with the observation ``OK.``; ``You arrive at loc N. `` is cut from observations;
- the episode ends when the env says won, when an action equals the one before it (the first
  compares with ``""``: the ``code`` evaluator's exact mode), or after the step cap;
- reflection prompt: the user's template with ``{examples}`` (the examples file verbatim),
  ``{trajectory}`` (the failed episode as the code's trial log holds it, from the first
  observation through ``STATUS: FAIL``; for the last game of the run the log's trial summary
  follows, as the code's log split leaves it) and ``{past_plans}`` (the last Ω earlier
  reflections, unstripped, numbered by position); the reflection is kept as the model wrote it.

The joins themselves live in ``agents/prompts/reflexion_code_layout.json``; :class:`CodeLayout`
is this protocol as an arm's prompt layout (:mod:`agents.layout`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.layout import FailedEpisode, PromptLayout, ReflectionAsk, StepTaker
from agents.parsing import put_to_move
from agents.prompting import PromptFileError, load_original_prompts, read_user_text
from memory.records import EnvReply, Step, StepKind

if TYPE_CHECKING:  # types only
    from agents.episode import EpisodeContext
    from agents.llm.base import Completion, Request

CODE_PROTOCOL = "reflexion-code"  # the --protocol value of this protocol
SHORT_OUTPUT = 5  # an output shorter than this (stripped) is asked again
TRIES = 6  # tries in all before the empty action is played
TEMPERATURE_STEP = 0.2  # added per try (the code: ``cur_try * 0.2``)
LAYOUT_FILE = "reflexion_code_layout.json"


@cache
def layout() -> dict[str, str]:
    """The protocol's joins (package data)."""
    raw = resources.files("agents.prompts").joinpath(LAYOUT_FILE).read_text()
    return {k: v for k, v in json.loads(raw).items() if not k.startswith("_")}


def layout_text() -> str:
    return resources.files("agents.prompts").joinpath(LAYOUT_FILE).read_text()


def read_wording(path: str | Path, role: str) -> str:
    """A wording file's text (``role`` names it in the one-line error)."""
    try:
        return read_user_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc.__class__.__name__
        raise PromptFileError(f"cannot read the {role} {str(path)!r}: {why}") from None


@dataclass(frozen=True)
class CodePrompts:
    """The user's wording for the protocol: four files, read once."""

    examples: dict[str, tuple[str, str]]
    instruction: str  # verbatim, its newline included
    reflection_template: str  # its last newline dropped
    reflection_examples: str  # verbatim
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        prompts: str | Path,
        instruction: str | Path,
        reflection_template: str | Path,
        reflection_examples: str | Path,
    ) -> CodePrompts:
        template = read_wording(reflection_template, "reflection template")
        if template.endswith("\n"):
            template = template[:-1]
        for name in ("{trajectory}", "{examples}"):
            if name not in template:
                raise PromptFileError(
                    f"reflection template {str(reflection_template)!r} has no {name} placeholder"
                )
        try:
            template.format(trajectory="", examples="", past_plans="")
        except (KeyError, IndexError, ValueError) as exc:
            raise PromptFileError(
                f"reflection template {str(reflection_template)!r}: bad placeholder {exc}"
                " (only {examples}, {trajectory}, {past_plans}; write {{ and }} for braces)"
            ) from None
        paths = {
            "prompts": str(prompts),
            "instruction": str(instruction),
            "reflection_template": str(reflection_template),
            "reflection_examples": str(reflection_examples),
        }
        return cls(
            examples=load_original_prompts(prompts, verbatim=True),
            instruction=read_wording(instruction, "instruction file"),
            reflection_template=template,
            reflection_examples=read_wording(reflection_examples, "reflection examples file"),
            paths=paths,
        )

    def pair(self, task_type: str) -> tuple[str, str]:
        try:
            return self.examples[task_type]
        except KeyError:
            raise PromptFileError(
                f"prompt file {self.paths.get('prompts', '')!r} has no react_{task_type}_0/_1"
            ) from None


# -- the actor -------------------------------------------------------------------------------------
def actor_prefix(prompts: CodePrompts, task_type: str, memory: Sequence[str]) -> str:
    """Everything before the first observation: instruction, examples, memory, task header.
    ``memory`` is the window already cut to the last Ω reflections, oldest first."""
    second, first = prompts.pair(task_type)
    lay = layout()
    text = prompts.instruction + second + first
    if memory:
        text += lay["memory_header"]
        for i, m in enumerate(memory):
            text += lay["memory_item"].format(index=i, text=m.strip())
    return text + lay["task_header"]


def history_text(observation: str, pairs: Sequence[tuple[str, str]]) -> str:
    """The first observation and the steps as the code's ``EnvironmentHistory`` prints them
    after its query (the prefix)."""
    lay = layout()
    items: list[str] = []
    for action, obs in pairs:
        items.append(lay["action_line"].format(action=action))
        items.append(obs)
    return observation + lay["history_start"] + lay["history_join"].join(items)


def actor_prompt(prefix: str, observation: str, pairs: Sequence[tuple[str, str]]) -> str:
    return prefix + history_text(observation, pairs) + layout()["prompt_end"]


def step_observation(observation: str) -> str:
    """The code's ``process_ob``: ``You arrive at loc N. `` is cut (ALFWorld < 0.4 said it)."""
    prefix = layout()["arrive_loc_prefix"]
    if observation.startswith(prefix):
        return observation[observation.find(". ") + 2 :]
    return observation


def is_short(text: str) -> bool:
    return len(text.strip()) < SHORT_OUTPUT


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (an API leaves the stop string out)."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def try_temperature(base: float, attempt: int) -> float:
    """The temperature of try ``attempt`` (0-based): the code's ``cur_try * 0.2`` above base."""
    return base + attempt * TEMPERATURE_STEP


def is_thought(action: str) -> bool:
    return action.startswith(layout()["thought_prefix"])


def thought_observation() -> str:
    return layout()["thought_observation"]


# -- the reflection --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrialSummary:
    """The counts the code's trial log ends with (cumulative successes after the trial)."""

    successes: int
    additional: int
    total: int

    def text(self) -> str:
        accuracy: Any = round(self.successes / self.total, 2) if self.total else 0.0
        return layout()["trial_summary"].format(
            successes=self.successes,
            additional=self.additional,
            failures=self.total - self.successes,
            total=self.total,
            accuracy=accuracy,
        )


def trajectory(
    observation: str, pairs: Sequence[tuple[str, str]], summary: TrialSummary | None = None
) -> str:
    """A failed episode as the code's reflection reads it from its trial log: the text after the
    last task header, through the status line (and, for the run's last game, the trial summary),
    stripped."""
    lay = layout()
    log = lay["task_header"] + history_text(observation, pairs)
    log += lay["status"].format(status=lay["status_fail"])
    if summary is not None:
        log += lay["log_end"] + summary.text()
    marker = lay["task_header"].strip()
    return log.split(marker)[-1].strip()


def past_plans(memory: Sequence[str]) -> str:
    lay = layout()
    if not memory:
        return ""
    items = "".join(lay["past_plan_item"].format(index=i, text=m) for i, m in enumerate(memory))
    return lay["past_plans_header"] + items


def reflection_prompt(
    prompts: CodePrompts,
    observation: str,
    pairs: Sequence[tuple[str, str]],
    memory: Sequence[str] = (),
    summary: TrialSummary | None = None,
) -> str:
    """The reflection prompt; ``memory`` is the window of earlier reflections (last Ω)."""
    return prompts.reflection_template.format(
        examples=prompts.reflection_examples,
        trajectory=trajectory(observation, pairs, summary),
        past_plans=past_plans(memory),
    )


# -- the layout ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CodeLayout(PromptLayout):
    """The paper's code's layout (see the module docstring): its prompts from the user's files
    (``prompts``), its
    steps, a reflection after every trial (the code writes one after the last too, and shows the
    run's last game the trial's counts), the whole prompt as a chat model's one user message
    (``code_put_to_move``: send ``put X in/on Y`` as ``move X to Y``, ALFWorld 0.4's syntax)."""

    prompts: CodePrompts
    code_put_to_move: bool = False

    name = CODE_PROTOCOL
    reflects_after_last_trial = True
    reads_trial_summary = True
    chat_instruction = ""

    @staticmethod
    def actor_prompt(prefix: str, observation: str, steps: Sequence[Step]) -> str:
        return actor_prompt(prefix, observation, [(s.action, s.observation) for s in steps])

    def prefix(self, task_type: str, reflections: Sequence[str], compose: Callable[[], str]) -> str:
        return actor_prefix(self.prompts, task_type, reflections)

    def reflection(self, on: FailedEpisode, compose: Callable[[], ReflectionAsk]) -> ReflectionAsk:
        pairs = [(s.action, s.observation) for s in on.steps]
        prompt = reflection_prompt(self.prompts, on.observation, pairs, on.past, on.summary)
        return ReflectionAsk(prompt, (), keep="as-written")

    async def act(
        self, actor: StepTaker, ctx: EpisodeContext, request: Request, state: EnvReply, index: int
    ) -> tuple[Step, EnvReply, bool]:
        """Up to six tries while the output is short, each a recorded call; the stripped text
        (or "") goes to the env as it is (``put X in/on Y`` as ``move X to Y`` only with
        ``code_put_to_move``; the prompt then shows what was sent); a ``think:`` action is shown with
        ``OK.``."""
        base = request.config
        texts: list[Completion] = []
        text = ""
        for attempt in range(TRIES):
            config = replace(base, temperature=try_temperature(base.temperature, attempt))
            completion = await ctx.generate(replace(request, config=config))
            texts.append(completion)
            out = cut_at_stop(completion.text, base.stop)
            if not is_short(out):
                text = out
                break
        action = text.strip()
        if self.code_put_to_move:
            action = put_to_move(action)
        state = await ctx.step(action)
        if is_thought(action):
            kind, observation = StepKind.THINK, thought_observation()
        else:
            kind = StepKind.ACT if action else StepKind.INVALID
            observation = step_observation(state.observation)
        step = Step(
            index=index,
            kind=kind.value,
            raw_output=texts[-1].text,
            action=action,
            observation=observation,
            admissible=action in state.admissible or kind == StepKind.THINK,
            prompt_tokens=sum(c.prompt_tokens for c in texts),
            completion_tokens=sum(c.completion_tokens for c in texts),
            cached_tokens=sum(c.cached_tokens for c in texts),
            latency_s=sum(c.latency_s for c in texts),
            reward=state.reward,
            won=state.won,
        )
        return step, state, state.truncated
