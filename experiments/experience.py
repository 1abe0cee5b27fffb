"""Experience of a gathering run, for runs on other games: read it, guard against
contamination, and extract its rules.

- :func:`load` reads a finished run's store as an :class:`~agents.experience.Experience`: its
  finished attempts, the rules extracted from them (meta ``insights``), and its provenance
  (the run, its split, its games' file hashes, a digest of what is shown).
- :func:`check_contamination` refuses a run whose games the experience played, or whose split
  it was gathered on: an evaluation episode never sees its own game's episodes or any episode
  of the split it is evaluated on.
- :func:`extract_rules` makes the rule list (:func:`agents.insights.extract`) and keeps it in the
  gathering run's store with every call that made it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agents import arms
from agents.experience import Attempt, Experience, ExperienceConfig, Provenance, Rule, digest
from agents.insights import extract
from agents.llm import make_backend
from agents.prompting import file_sha256, transcript_pairs
from agents.retrieval import check_similarity
from experiments.config import RunConfig
from experiments.engine import ModelClient
from experiments.errors import ConfigError, RunStoreError
from experiments.lock import DirLock
from experiments.store import LOCK_NAME, EpisodeRow, RunReader, RunStore
from memory.records import EpisodeStatus

INSIGHTS_KEY = "insights"  # the store's meta key of the extracted rules and their calls


def settings_of(cfg: RunConfig) -> ExperienceConfig:
    """The run's ``experience`` section (the experience arms' options)."""
    settings: ExperienceConfig = cfg.section("experience")
    return settings


def load(run_dir: str | Path, settings: ExperienceConfig = ExperienceConfig()) -> Experience:
    """The experience of the run in ``run_dir``; a RunStoreError when it is not a run."""
    with RunReader(run_dir) as store:
        manifest = store.get_meta("manifest") or {}
        attempts = tuple(
            Attempt(
                e.game,
                e.task_type,
                e.trial,
                e.won,
                e.observation,
                tuple(transcript_pairs(store.steps(e.episode_id))),
            )
            for e in store.episodes()
            if e.status == EpisodeStatus.DONE.value
        )
        extracted = store.get_meta(INSIGHTS_KEY) or {}
    rules = tuple(Rule.from_json(r) for r in extracted.get("rules", []))
    config = manifest.get("config", {})
    provenance = Provenance(
        run=str(run_dir),
        split=str(config.get("split", "")),
        games=dict(manifest.get("games", {})),
        digest=digest(attempts, rules),
    )
    return Experience(provenance, attempts, rules, settings)


def check_contamination(experience: Experience, split: str, games: dict[str, str]) -> None:
    """A one-line ConfigError naming the experience source when a run on ``games`` (id -> file
    hash) of ``split`` would be shown its own games' episodes or its split's."""
    source = experience.provenance
    where = f"experience {source.run!r}"
    if source.split == split:
        raise ConfigError(
            f"{where} was gathered on the split this run evaluates ({split}): gather on "
            "another split (train) or evaluate on another"
        )
    hashes = set(source.games.values())
    shared = sorted(g for g, h in games.items() if g in source.games or h in hashes)
    if shared:
        raise ConfigError(
            f"{where} holds episodes of {len(shared)} game(s) this run plays ({shared[0]}): "
            "gather on other games"
        )


def for_run(cfg: RunConfig, split: str, games: Mapping[str, Path]) -> Experience | None:
    """The experience a run is shown, checked against its games (id -> game file); None when it
    uses none. An
    arm that needs experience without ``experience_from`` is a ConfigError. An arm that shows
    rules of a source not yet extracted extracts them first, with the run's reflector model
    (the ``extract`` phase of a gather, extract, evaluate preset)."""
    source = settings_of(cfg).experience_from
    needs = getattr(arms.get(cfg.protocol.agent).memory, "uses_experience", None)
    if source is None:
        if needs:
            raise ConfigError(
                f"--agent {cfg.protocol.agent} shows experience of other games: add "
                "--experience-from RUN_DIR (a gathering run)"
            )
        return None
    try:
        experience = load(source, settings_of(cfg))
        hashes = {g: file_sha256(p) for g, p in games.items()}
        check_contamination(experience, split, hashes)
        if needs == "rules" and not has_rules(source):
            extract_rules(source, cfg.models.reflector, cfg.models.reflect_max_tokens)
            experience = load(source, settings_of(cfg))
    except RunStoreError as exc:
        raise ConfigError(f"--experience-from: {exc}") from None
    check_similarity(experience.settings.similarity)
    return experience


def has_rules(run_dir: str | Path) -> bool:
    """Whether the rules of the run in ``run_dir`` were extracted (none may have been made)."""
    with RunReader(run_dir) as store:
        return store.get_meta(INSIGHTS_KEY) is not None


def extract_rules(run_dir: str | Path, model: str, max_tokens: int = 256) -> dict[str, Any]:
    """Extract the rules of the gathering run in ``run_dir`` with ``model`` (a model spec) and
    keep them, with every call, in its store (meta ``insights``); returns what was kept."""
    experience = load(run_dir)
    lock = DirLock(Path(run_dir), LOCK_NAME)
    lock.acquire(what="a rule extraction")
    backend = None
    try:
        backend = make_backend(model)
        client = ModelClient(backend, max_in_flight=1)
        try:
            rules, steps = asyncio.run(extract(client, experience.attempts, max_tokens=max_tokens))
        finally:
            client.close()
        kept = {
            "model": model,
            "source_digest": experience.provenance.digest,
            "made_at": time.time(),
            "rules": [r.to_json() for r in rules],
            "steps": [s.to_json() for s in steps],
        }
        store = RunStore(run_dir)
        try:
            store.set_meta(INSIGHTS_KEY, kept)
        finally:
            store.close()
    finally:
        lock.release()
        if backend is not None:
            backend.close()
    return kept


def _success_by_type(run_dir: str | Path) -> dict[str, dict[str, float]]:
    """Per task type: the share of games won at trial 0, and by the last trial."""
    with RunReader(run_dir) as store:
        episodes = store.episodes()
    out: dict[str, dict[str, float]] = {}
    for task_type in sorted({e.task_type for e in episodes}):
        games = {e.game for e in episodes if e.task_type == task_type}
        first = {e.game for e in episodes if e.task_type == task_type and e.trial == 0 and e.won}
        won = {e.game for e in episodes if e.task_type == task_type and e.won}
        out[task_type] = {"games": len(games), "trial0": len(first) / len(games)}
        out[task_type]["final"] = len(won) / len(games)
    return out


def shown(episode: EpisodeRow) -> dict[str, list[dict[str, Any]]]:
    """The experience the episode's prompt showed, as recorded when it was made: ``rules``
    (task_type, text, votes) and ``retrieved`` (game, trial, task_type, score); both empty for
    an episode that recorded none (an arm without experience, or a store older than the
    record). Items that are not objects are left out."""
    try:
        record = json.loads(episode.experience_json or "{}")
    except ValueError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    return {
        key: [item for item in record.get(key) or [] if isinstance(item, dict)]
        for key in ("rules", "retrieved")
    }


def summary(run_dir: str | Path, baseline: str | Path | None = None) -> dict[str, Any]:
    """What experience did in a run: the rule list's growth per extraction step (a gathering
    run), the rules and retrieved games each episode was shown (a run that used experience; as
    each episode recorded them, so the source run need not exist any more),
    and success per task type, beside ``baseline``'s (a run on the same games without it)."""
    with RunReader(run_dir) as store:
        manifest = store.get_meta("manifest") or {}
        episodes = store.episodes()
        kept = store.get_meta(INSIGHTS_KEY)
    out: dict[str, Any] = {"run": str(run_dir)}
    if kept is not None:
        out["rule_growth"] = [
            {"step": i, "task_type": s["task_type"], "games": s["games"],
             "applied": s["applied"], "ignored": s["ignored"], "rules_after": s["rules_after"]}
            for i, s in enumerate(kept["steps"])
        ]  # fmt: skip
    used = manifest.get("experience")
    if used is not None:
        out["experience"] = used
        out["episodes"] = [
            {"episode": e.episode_id, "task_type": e.task_type, "won": e.won, **shown(e)}
            for e in episodes
        ]
    out["success_by_type"] = _success_by_type(run_dir)
    if baseline is not None:
        out["baseline"] = str(baseline)
        out["baseline_success_by_type"] = _success_by_type(baseline)
    return out
