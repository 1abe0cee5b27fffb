"""What the replay page shows, as JSON-safe dicts read from a run store (read-only)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agents import arms
from agents.parsing import was_mapped
from agents.prompting import transcript_action
from experiments.errors import RunStoreError
from experiments.experience import INSIGHTS_KEY, shown, summary
from experiments.prompts import StepPrompt, step_prompts
from experiments.store import EpisodeRow, Outcome, RunReader, StepCounts, shared_prefix
from memory.records import EndClass, ModelCall, SearchTree, Step, StepKind, classify_end

log = logging.getLogger("reflexsim.viewer")

if TYPE_CHECKING:  # types only: the report imports the viewer's page writer
    from experiments.report import RunSummary


def step_prompt(
    reader: RunReader, episode: EpisodeRow, steps: Sequence[Step], index: int
) -> StepPrompt:
    """The request the model answered with step ``index``, as the run recorded it (rebuilt,
    and marked so, in a store written before requests were recorded)."""
    if not 0 <= index < len(steps):
        raise IndexError(f"episode {episode.episode_id!r} has no step {index}")
    return step_prompts(reader, episode, steps[: index + 1])[index]


def prompt_view(prompt: StepPrompt) -> dict[str, Any]:
    """A step's request as the page shows it: its text, messages, every other field sent, and
    whether it was recorded or rebuilt."""
    sent = prompt.sent
    return {
        "step": prompt.index,
        "prompt": prompt.shown,
        "messages": sent.chat if sent.messages is not None else None,
        "params": dict(sent.params),
        "source": "rebuilt" if prompt.rebuilt else "recorded",
        "purpose": prompt.call.purpose if prompt.call is not None else "act",
    }


def call_view(call: ModelCall, with_prompt: bool) -> dict[str, Any]:
    """One model call of an episode (every field of its record); its request's text only when
    ``with_prompt`` (a step's own prompt is shown with its step)."""
    sent = call.sent
    view = {k: v for k, v in call.to_dict().items() if k not in ("sent", "rebuilt", "id")}
    view["recorded"] = sent is not None
    view["params"] = dict(sent.params) if sent is not None else None
    if with_prompt and sent is not None:
        view["prompt"] = sent.prompt
        view["messages"] = sent.chat if sent.messages is not None else None
    return view


def run_index(
    reader: RunReader, run_id: int, label: str, summary: RunSummary | None
) -> dict[str, Any]:
    """The run's header, summary and the outcome of every episode (no steps); a failure class
    as the report counts it (:func:`memory.records.classify_end`)."""
    manifest = reader.get_meta("manifest") or {}
    config = manifest.get("config") or {}
    counts = reader.step_counts()
    outcomes = reader.outcomes()
    arm = str(config.get("agent") or (outcomes[0].arm if outcomes else ""))
    ends = arms.ends(arm)
    episodes = [
        {
            "id": o.episode_id,
            "game": o.game,
            "task_type": o.task_type,
            "trial": o.trial,
            "status": o.status.value,
            "won": o.won,
            "failure_class": _failure_class(o, ends),
            "verdict": o.verdict,
            "judge_verdict": o.judge_verdict,
            **dataclasses.asdict(counts.get(o.episode_id, StepCounts())),
        }
        for o in outcomes
    ]
    return {
        "id": run_id,
        "label": label,
        "model": str(config.get("model", "")),
        "arm": arm,
        "evaluator": str(config.get("evaluator", "")),
        "status": reader.run_state().to_dict(),
        "summary": summary.to_dict() if summary is not None else None,
        "trials": [{"trial": t.trial, "tasks": list(t.tasks)} for t in reader.trial_rows()],
        "episodes": episodes,
        "experience": run_experience(reader, manifest),
    }


def run_experience(reader: RunReader, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """A gathering run's rule growth per extraction step, and a run shown experience: its
    source and success per task type (:func:`experiments.experience.summary`, without the
    episodes); None for a run that is neither."""
    try:
        if reader.get_meta(INSIGHTS_KEY) is None and manifest.get("experience") is None:
            return None
        seen = summary(reader.run_dir)
    except RunStoreError as exc:  # a malformed kept rule list: the run is shown without it
        log.warning("%s", exc)
        return None
    return {k: seen[k] for k in ("rule_growth", "experience", "success_by_type") if k in seen}


def _failure_class(o: Outcome, ends: tuple[EndClass, ...]) -> str | None:
    """A failed episode's class as the report counts it; None for one that has none."""
    return classify_end(o.failure_class, o.verdict, ends).value if o.failure_class else None


def prompt_memory(episode: EpisodeRow) -> list[dict[str, Any]]:
    """The reflections shown in the episode's prompt (from its recorded memory)."""
    try:
        items = json.loads(episode.memory_json)
    except ValueError:
        return []
    return [
        {
            "trial": r.get("trial"),
            "text": str(r.get("text", "")),
            "model": str(r.get("model", "")),
            "episode_id": str(r.get("episode_id", "")),
        }
        for r in items
        if isinstance(r, dict)
    ]


def episode_detail(reader: RunReader, episode: EpisodeRow, steps: Sequence[Step]) -> dict[str, Any]:
    """One episode step by step, with the reflections and the experience of other games its
    prompt showed (None: it recorded none), the reflection it led to, and every model call made
    for it (``calls``: a step's prompt is the step's; the others' prompts and answers are here).
    Each step's prompt is there as what it keeps of the one before (the first step's: of the
    prompt prefix) and what it adds (``prompt_keep``, ``prompt_add``), with its ``source``."""
    after = [r for r in reader.reflections(episode.game) if r.trial == episode.trial]
    calls = reader.episode_calls(episode)
    prompts = step_prompts(reader, episode, steps, calls=[c for c in calls if c.episode_id])
    made = {id(p.call) for p in prompts if p.call is not None}
    return {
        "id": episode.episode_id,
        "game": episode.game,
        "task": episode.task,
        "task_type": episode.task_type,
        "trial": episode.trial,
        "arm": episode.arm,
        "status": episode.status.value,
        "won": episode.won,
        "failure_class": _failure_class(episode, arms.ends(episode.arm)),
        "verdict": episode.verdict,
        "judge_verdict": episode.judge_verdict,
        "judge_reason": episode.judge_reason,
        "error": episode.error,
        "observation": episode.observation,
        "attempts": episode.attempts,
        "attempt_errors": [
            {"attempt": e.attempt, "kind": e.kind, "error": e.error, "traceback": e.traceback}
            for e in reader.episode_errors(episode.episode_id)
        ],
        "resimulated": episode.resimulated,
        "started_at": episode.started_at,
        "finished_at": episode.finished_at,
        "memory": prompt_memory(episode),
        "experience": shown(episode) if episode.experience_json is not None else None,
        "reflection": (
            {"trial": after[0].trial, "text": after[0].text, "model": after[0].model}
            if after
            else None
        ),
        "steps": [
            {
                **s.to_dict(),
                "kind": str(s.kind),
                "transcript_action": transcript_action(s),
                "mapped": s.kind == StepKind.ACT and was_mapped(s.raw_output, s.action),
                **_prompt_delta(prompts, k, episode.prompt_prefix),
            }
            for k, s in enumerate(steps)
        ],
        "calls": [call_view(c, id(c) not in made) for c in calls],
        "tree": tree_view(reader.search_tree(episode.episode_id)),
    }


def _prompt_delta(prompts: Sequence[StepPrompt], k: int, prefix: str) -> dict[str, Any]:
    """Step ``k``'s prompt as the page rebuilds it: the leading part it keeps of the previous
    step's shown text (step 0: of the prefix), and the rest."""
    before = prompts[k - 1].shown if k else prefix
    text = prompts[k].shown
    keep = shared_prefix(before, text)
    return {
        "prompt_keep": keep,
        "prompt_add": text[keep:],
        "prompt_source": "rebuilt" if prompts[k].rebuilt else "recorded",
    }


def tree_view(tree: SearchTree | None) -> dict[str, Any] | None:
    """A searched episode's tree: its nodes (with mean reward), iterations and end; the nodes
    each backtracking iteration selected are flagged ``backtrack``."""
    if tree is None:
        return None
    backtracks = {it.selected for it in tree.iterations if it.backtrack}
    nodes = [
        {
            **n.to_dict(),
            "mean": n.total / n.visits if n.visits else None,
            "executed": n.observation is not None,
            "backtrack": n.node_id in backtracks,
        }
        for n in tree.nodes
    ]
    return {
        "nodes": nodes,
        "iterations": [it.to_dict() for it in tree.iterations],
        "end": tree.end.to_dict() if tree.end else None,
    }


def load_episode(reader: RunReader, episode_id: str) -> dict[str, Any] | None:
    row = reader.episode(episode_id)
    if row is None:
        return None
    return episode_detail(reader, row, reader.steps(episode_id))
