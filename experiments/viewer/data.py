"""What the replay page shows, as JSON-safe dicts read from a run store (read-only)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agents.prompting import actor_prompt
from experiments.report import episode_outcomes
from experiments.store import EpisodeRow, RunStore
from memory.records import Step


def history_action(step: Step) -> str:
    """The action text the transcript shows for a step (as the rollout renders it)."""
    return step.action or step.raw_output.strip()


def step_prompt(episode: EpisodeRow, steps: Sequence[Step], index: int) -> str:
    """The exact prompt the model answered with step ``index``."""
    if not 0 <= index < len(steps):
        raise IndexError(f"episode {episode.episode_id!r} has no step {index}")
    history = [(history_action(s), s.observation) for s in steps[:index]]
    return actor_prompt(episode.prompt_prefix, episode.observation, history)


def _step_counts(store: RunStore) -> dict[str, dict[str, int]]:
    rows = store.conn.execute(
        "SELECT episode_id, COUNT(*) n, SUM(kind = 'invalid') invalid,"
        " SUM(kind = 'act' AND admissible = 0) inadmissible, SUM(kind = 'think') think"
        " FROM steps GROUP BY episode_id"
    ).fetchall()
    return {
        r["episode_id"]: {
            "steps": r["n"],
            "invalid": r["invalid"] or 0,
            "inadmissible": r["inadmissible"] or 0,
            "thoughts": r["think"] or 0,
        }
        for r in rows
    }


def run_index(
    store: RunStore, run_id: int, label: str, summary: dict[str, Any] | None
) -> dict[str, Any]:
    """The run's header, summary and the outcome of every episode (no steps)."""
    manifest = store.get_meta("manifest") or {}
    config = manifest.get("config") or {}
    counts = _step_counts(store)
    empty = {"steps": 0, "invalid": 0, "inadmissible": 0, "thoughts": 0}
    episodes = [
        {
            "id": o.episode_id,
            "game": o.game,
            "task_type": o.task_type,
            "trial": o.trial,
            "status": o.status,
            "won": o.won,
            "failure_class": o.failure_class,
            "verdict": o.verdict,
            "judge_verdict": o.judge_verdict,
            **counts.get(o.episode_id, empty),
        }
        for o in episode_outcomes(store)
    ]
    return {
        "id": run_id,
        "label": label,
        "model": str(config.get("model", "")),
        "arm": str(config.get("agent") or _first_arm(store)),
        "evaluator": str(config.get("evaluator", "")),
        "status": store.get_meta("status"),
        "summary": summary,
        "trials": [{"trial": t["trial"], "tasks": t["tasks"]} for t in store.trials()],
        "episodes": episodes,
    }


def _first_arm(store: RunStore) -> str:
    row = store.conn.execute("SELECT arm FROM episodes LIMIT 1").fetchone()
    return str(row["arm"]) if row else ""


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


def episode_detail(store: RunStore, episode: EpisodeRow, steps: Sequence[Step]) -> dict[str, Any]:
    """One episode step by step, with the reflections its prompt showed and the one it led to."""
    after = [r for r in store.reflections(episode.game) if r.trial == episode.trial]
    return {
        "id": episode.episode_id,
        "game": episode.game,
        "task": episode.task,
        "task_type": episode.task_type,
        "trial": episode.trial,
        "arm": episode.arm,
        "status": episode.status,
        "won": episode.won,
        "failure_class": episode.failure_class,
        "verdict": episode.verdict,
        "judge_verdict": episode.judge_verdict,
        "judge_reason": episode.judge_reason,
        "error": episode.error,
        "observation": episode.observation,
        "attempts": episode.attempts,
        "resimulated": episode.resimulated,
        "started_at": episode.started_at,
        "finished_at": episode.finished_at,
        "memory": prompt_memory(episode),
        "reflection": (
            {"trial": after[0].trial, "text": after[0].text, "model": after[0].model}
            if after
            else None
        ),
        "steps": [{**s.to_dict(), "history_action": history_action(s)} for s in steps],
    }


def load_episode(store: RunStore, episode_id: str) -> dict[str, Any] | None:
    row = store.episode(episode_id)
    if row is None:
        return None
    return episode_detail(store, row, store.steps(episode_id))
