"""Experience of a gathering run, for runs on other games: read it, guard against
contamination, and extract its rules.

- :func:`load` reads a finished run's store as an :class:`~agents.experience.Experience`: its
  finished attempts, the rules extracted from them (meta ``insights``), and its provenance
  (the run, its split, its games' file hashes, a digest of what is shown).
- :func:`check_contamination` refuses a run whose games the experience played, or whose split
  it was gathered on: an evaluation episode never sees its own game's episodes or any episode
  of the split it is evaluated on.
- :func:`extract_rules` makes the rule list (:func:`agents.insights.extract`) and keeps it in the
  gathering run's store with every call that made it, under the gathering run's lock, with the
  digest of the attempts it was made from. A run that shows rules extracts them in its own
  phase (:func:`with_current_rules`): after its checks and its own lock, with its reflector
  model, only when the kept ones are missing or were made from other attempts (the source was
  resumed since); runs that start together (a preset on Ray) wait for one extraction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agents import arms
from agents.experience import Attempt, Experience, ExperienceConfig, Provenance, Rule, digest
from agents.insights import ExtractionStep, extract
from agents.llm import make_backend
from agents.llm.base import Backend, BackendError, ContextLimitError
from agents.prompting import file_sha256, transcript_pairs
from agents.retrieval import check_similarity
from experiments.config import RunConfig
from experiments.engine import ModelClient
from experiments.errors import ConfigError, InfraError, RunStoreError
from experiments.lock import DirLock
from experiments.store import LOCK_NAME, EpisodeRow, RunReader, RunStore, open_reader
from memory.records import EpisodeStatus

INSIGHTS_KEY = "insights"  # the store's meta key of the extracted rules and their calls
EXTRACT_WAIT_S = 1800.0  # how long a run waits for another process extracting the same source

log = logging.getLogger(__name__)


def settings_of(cfg: RunConfig) -> ExperienceConfig:
    """The run's ``experience`` section (the experience arms' options)."""
    settings: ExperienceConfig = cfg.section("experience")
    return settings


def load(
    run_dir: str | Path, settings: ExperienceConfig = ExperienceConfig(), *, rules: bool = True
) -> Experience:
    """The experience of the run in ``run_dir`` (without its kept rules unless ``rules``); a
    RunStoreError when it is not a run, or when the rules it keeps are malformed."""
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
        extracted = (kept_rules(store) if rules else None) or {}
    rule_list = tuple(Rule.from_json(r) for r in extracted.get("rules", []))
    config = manifest.get("config", {})
    provenance = Provenance(
        run=str(run_dir),
        split=str(config.get("split", "")),
        games=dict(manifest.get("games", {})),
        digest=digest(attempts, rule_list),
    )
    return Experience(provenance, attempts, rule_list, settings)


# what each extraction step must hold for the summary and the viewer
_STEP_FIELDS = {
    "task_type": str,
    "games": list,
    "applied": list,
    "ignored": list,
    "rules_after": int,
}


def kept_rules(store: RunReader) -> dict[str, Any] | None:
    """The rule list kept in ``store`` (meta ``insights``), checked: None when none was made; a
    one-line RunStoreError naming the fix when it is not what :func:`extract_with` writes (a
    hand edit, another tool). It is not made again in its place: that would drop the edit."""
    try:
        kept = store.get_meta(INSIGHTS_KEY)
        problem = None if kept is None else _malformed(kept)
    except RunStoreError:
        kept, problem = {}, "it is not JSON that Python reads"
    if kept is None:
        return None
    if problem is not None:
        run = store.run_dir
        raise RunStoreError(
            f"the rule list kept in {str(run)!r} (meta {INSIGHTS_KEY}) is malformed: {problem}; "
            f"make it again with `reflexsim extract {run} --model SPEC`"
        )
    return dict(kept)


def _malformed(kept: Any) -> str | None:
    """What is wrong with a kept rule list, or None."""
    if not isinstance(kept, dict):
        return f"a {type(kept).__name__}, not an object"
    rules, steps = kept.get("rules"), kept.get("steps")
    if not isinstance(rules, list) or not isinstance(steps, list):
        return "its rules or steps are not lists"
    for i, rule in enumerate(rules):
        try:
            Rule.from_json(rule)
        except (KeyError, TypeError, ValueError) as exc:
            return f"rule {i + 1}: {type(exc).__name__} {exc}"
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or any(
            not isinstance(step.get(k), t) or isinstance(step.get(k), bool)
            for k, t in _STEP_FIELDS.items()
        ):
            return f"step {i + 1} lacks one of {', '.join(_STEP_FIELDS)}"
    return None


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
    uses none. Reads only: an arm that needs experience without ``experience_from``, a source
    that is not a finished run, or one that would leak into these games is a ConfigError. Rules
    not yet extracted are made later, by :func:`with_current_rules` (the run's extract phase,
    once it holds its lock)."""
    source = settings_of(cfg).experience_from
    if source is None:
        if uses_experience(cfg):
            raise ConfigError(
                f"--agent {cfg.protocol.agent} shows experience of other games: add "
                "--experience-from RUN_DIR (a gathering run)"
            )
        return None
    try:
        _refuse_unfinished(source)
        experience = load(source, settings_of(cfg))
    except RunStoreError as exc:
        raise ConfigError(f"--experience-from: {exc}") from None
    hashes = {g: file_sha256(p) for g, p in games.items()}
    check_contamination(experience, split, hashes)
    check_similarity(experience.settings.similarity)
    return experience


def _refuse_unfinished(run_dir: str | Path) -> None:
    """A RunStoreError when the run in ``run_dir`` has not played all its tasks (a gathering
    run still being written, stopped, or left with errors shows part of its experience)."""
    with RunReader(run_dir) as store:
        state = store.run_state()
    if not state.complete:
        raise RunStoreError(
            f"the gathering run {str(run_dir)!r} is {state.status.value} "
            f"({state.finished} of {state.tasks} tasks finished): finish it first "
            f"(reflexsim run --resume {run_dir})"
        )


def uses_experience(cfg: RunConfig) -> str | None:
    """What of other games' experience the run's arm shows ("rules", "trajectories"), or None."""
    return getattr(arms.get(cfg.protocol.agent).memory, "uses_experience", None)


def needs_rules(cfg: RunConfig) -> bool:
    """Whether the run's arm shows the rules of its experience."""
    return uses_experience(cfg) == "rules"


def with_current_rules(
    experience: Experience, backend: Backend, model: str, max_tokens: int
) -> Experience:
    """``experience`` with rules extracted from its attempts as they are now: kept ones when
    they were made from the same attempts, else made now with ``backend`` (``model``: its spec,
    recorded) and kept in the source's store. Another process extracting the same source is
    waited for (its rules are then used)."""
    source = experience.provenance.run
    kept = _current(source, experience)
    if kept is not None:
        if [r.to_json() for r in experience.rules] == kept.get("rules"):
            return experience  # loaded with those very rules
        return load(source, experience.settings)  # made since it was loaded
    log.info("extracting the rules of %s with %s", source, model)
    extract_with(source, backend, model, max_tokens, wait_s=EXTRACT_WAIT_S, keep_current=True)
    return load(source, experience.settings)


def _current(run_dir: str | Path, experience: Experience | None = None) -> dict[str, Any] | None:
    """The rules kept in the run's store when they were made from its attempts as they are
    now (``experience``: the run, already loaded); None when none were made, or the run changed
    after (it was resumed with more trials)."""
    with RunReader(run_dir) as store:
        kept = kept_rules(store)
    if kept is None:
        return None
    attempts = experience if experience is not None else load(run_dir, rules=False)
    return kept if kept.get("source_digest") == source_digest(attempts) else None


def source_digest(experience: Experience) -> str:
    """The digest of what rules are made from: the source's attempts alone."""
    return digest(experience.attempts, ())


def has_rules(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` has rules extracted from its attempts as they are now
    (none may have been made)."""
    return _current(run_dir) is not None


def extract_rules(
    run_dir: str | Path,
    model: str,
    max_tokens: int = 256,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Extract the rules of the gathering run in ``run_dir`` with ``model`` (a model spec, its
    backend made with ``options``: ``base_url``, retries, ...) and keep them, with every call,
    in its store (meta ``insights``); returns what was kept. A folder that holds no run is
    refused before anything is made in it (no lock file)."""
    open_reader(run_dir).close()
    backend = make_backend(model, **dict(options or {}))
    try:
        return extract_with(run_dir, backend, model, max_tokens)
    finally:
        backend.close()


def extract_with(
    run_dir: str | Path,
    backend: Backend,
    model: str,
    max_tokens: int = 256,
    wait_s: float = 0.0,
    keep_current: bool = False,
) -> dict[str, Any]:
    """:func:`extract_rules` with a built ``backend`` (``model``: its spec). The source's lock is
    held throughout (waiting up to ``wait_s`` for another holder); with ``keep_current``, rules
    another process made from the same attempts meanwhile are kept and returned."""
    lock = DirLock(Path(run_dir), LOCK_NAME)
    lock.acquire(wait_s, what="a rule extraction")
    try:
        experience = load(run_dir, rules=False)  # a malformed kept list is replaced here
        kept = _current(run_dir, experience) if keep_current else None
        if kept is not None:
            return kept
        rules, steps = _extract(run_dir, backend, experience, max_tokens)
        kept = {
            "model": model,
            "source_digest": source_digest(experience),
            "made_at": time.time(),
            "rules": [r.to_json() for r in rules],
            "steps": [s.to_json() for s in steps],
        }
        store = RunStore(run_dir)
        try:
            store.set_meta(INSIGHTS_KEY, kept)
        finally:
            store.close()
        log.info("made %d rules of %s with %s in %d calls", len(rules), run_dir, model, len(steps))
    finally:
        lock.release()
    return kept


def _extract(
    run_dir: str | Path, backend: Backend, experience: Experience, max_tokens: int
) -> tuple[tuple[Rule, ...], list[ExtractionStep]]:
    """The rules and calls of :func:`agents.insights.extract`, through the backend's retries as
    an episode's calls go; a request that still fails is a one-line error: an InfraError (the
    command run again retries it), or a ConfigError for a prompt over the model's context."""
    client = ModelClient(backend, max_in_flight=1)
    try:
        return asyncio.run(extract(client, experience.attempts, max_tokens=max_tokens))
    except ContextLimitError as exc:
        raise ConfigError(
            f"rule extraction of {run_dir}: {exc}: extract with a model of a longer context"
        ) from None
    except BackendError as exc:
        raise InfraError(
            f"rule extraction of {run_dir} failed: {exc}; nothing was kept or played: run the "
            "command again"
        ) from None
    finally:
        client.close()


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
        kept = kept_rules(store)
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
