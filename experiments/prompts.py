"""The prompt each step of an episode answered, read from the run's record of its model calls.

The store keeps every model call as its backend sent it (:meth:`RunReader.model_calls`); this
module finds the call that made each step: a call of the episode at that step whose answer is
the step's text (of several, the latest, preferring one whose text continues the previous
step's: a tree search asks at one depth from many nodes). The viewer, ``reflexsim replay`` and
the training export read prompts here and nowhere else.

A step with no recorded call (a store written before requests were recorded) gets its prompt
rebuilt from the stored prefix and steps with the protocol's layout, and says so (``rebuilt``):
a rebuilt prompt is what the code of today would send, not a record of what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agents.layout import PromptLayout
from agents.reflexion_code import CodeLayout
from experiments.store import EpisodeRow, RunReader, shared_prefix
from memory.records import ModelCall, SentRequest, Step

# How many trailing characters of a step's text the next step's may differ in and still count
# as continuing it (the code protocol's ``>``; chat messages' closing JSON).
_TAIL = 8


@dataclass(frozen=True)
class StepPrompt:
    """The request step ``index`` answered: as recorded (``call``), or rebuilt (``rebuilt``)."""

    index: int
    sent: SentRequest
    answer: str  # the model's text the step was made of
    call: ModelCall | None = None  # None: rebuilt

    @property
    def rebuilt(self) -> bool:
        return self.call is None

    @property
    def shown(self) -> str:
        return request_text(self.sent)


def request_text(sent: SentRequest) -> str:
    """A request as one text to read: the prompt, or each message under its role."""
    if sent.prompt is not None:
        return sent.prompt
    return "\n\n".join(f"[{role}]\n{content}" for role, content in sent.messages or ())


LAYOUTS: dict[str, type[PromptLayout]] = {k.name: k for k in (PromptLayout, CodeLayout)}


def layout_class(protocol: str) -> type[PromptLayout]:
    """The prompt layout of the protocol named ``protocol`` (ReAct's for "" or an unknown
    name: a run written before the protocol was recorded)."""
    return LAYOUTS.get(protocol, PromptLayout)


def protocol_of(reader: RunReader) -> str:
    """The prompt protocol the run played ("" when its manifest names none)."""
    config = (reader.get_meta("manifest") or {}).get("config") or {}
    return str(config.get("protocol") or "")


def step_prompts(
    reader: RunReader,
    episode: EpisodeRow,
    steps: Sequence[Step],
    protocol: str | None = None,
    calls: Sequence[ModelCall] | None = None,
) -> list[StepPrompt]:
    """The prompt of every step of ``episode`` (``calls``: its model calls, when the caller
    read them already; ``protocol``: the run's, for rebuilt prompts)."""
    if calls is None:
        calls = reader.model_calls(episode.episode_id)
    at: dict[int, list[ModelCall]] = {}
    for c in calls:
        if c.sent is not None and c.step is not None and c.episode_id == episode.episode_id:
            at.setdefault(c.step, []).append(c)
    out: list[StepPrompt] = []
    for k, step in enumerate(steps):
        made = [c for c in at.get(k, ()) if step.raw_output in (c.answer, *c.alternatives)]
        call = _continuing(made, out[-1] if out else None)
        if call is None and not made:
            call = next((c for c in reversed(at.get(k, ())) if c.purpose == "act"), None)
        if call is not None:
            assert call.sent is not None
            out.append(StepPrompt(k, call.sent, step.raw_output, call))
            continue
        if protocol is None:
            protocol = protocol_of(reader)
        layout = layout_class(protocol)  # the actor prompt needs none of its files
        text = layout.actor_prompt(episode.prompt_prefix, episode.observation, steps[:k])
        out.append(StepPrompt(k, SentRequest(prompt=text), step.raw_output))
    return out


def _continuing(calls: Sequence[ModelCall], before: StepPrompt | None) -> ModelCall | None:
    """The latest of ``calls`` whose text continues the previous step's, else the latest."""
    if not calls:
        return None
    if before is not None:
        prev = before.sent.text
        for c in reversed(calls):
            assert c.sent is not None
            if shared_prefix(prev, c.sent.text) >= len(prev) - _TAIL:
                return c
    return calls[-1]
