"""Experience across tasks: rules extracted from a gathering run on some generated games, shown
to new games (the insights arm), and the guard that keeps evaluation games' episodes out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agents.experience import Attempt, Rule
from agents.insights import apply_ops, parse_ops
from agents.llm.markers import RULES_MARKER
from envs.alfgen import generate
from experiments.cli import main
from experiments.experience import extract_rules, load
from experiments.runner import run
from experiments.store import RunReader
from tests.gameruns import game_run

GATHER_TYPES = ["put", "clean", "heat"]  # the types the gathering run plays; the others not
ALL_TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")


@pytest.fixture(scope="module")
def train_games(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    generate(root, per_type=1, seed=3, task_types=GATHER_TYPES, split="train")
    return root


@pytest.fixture(scope="module")
def gathered(train_games: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Reflexion with the learner on the train games (fails, reflects, wins), then extraction."""
    tmp = tmp_path_factory.mktemp("gather")
    cfg = game_run(
        train_games, tmp, "gather", "reflexion", split="train", trials=2,
        model="scripted:learner", max_steps=8,
    )  # fmt: skip
    run(cfg)
    extract_rules(tmp / "gather", "scripted:expert")
    return tmp / "gather"


def prefixes(run_dir: Path) -> dict[tuple[str, str], str]:
    with RunReader(run_dir) as store:
        return {(e.game, e.task_type): e.prompt_prefix for e in store.episodes()}


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


@pytest.mark.parametrize("scope", ["type", "all"])
def test_rules_raise_trial0_success_to_the_share_of_ruled_types(
    gathered: Path, generated_games: Path, tmp_path: Path, scope: str
) -> None:
    """scripted:ruled wins only with a rule naming its type in its prompt: without experience
    it solves nothing; with it, exactly the games whose type got a rule (3 of 6)."""
    base = game_run(generated_games, tmp_path, "react", "react", model="scripted:ruled")
    run(base)
    assert trial0_success(tmp_path / "react") == 0.0
    cfg = game_run(
        generated_games, tmp_path, "insights", "insights", model="scripted:ruled",
        experience_from=str(gathered), experience_scope=scope,
    )  # fmt: skip
    run(cfg)
    assert trial0_success(tmp_path / "insights") == len(GATHER_TYPES) / len(ALL_TYPES)
    for (_, task_type), prefix in prefixes(tmp_path / "insights").items():
        block = prefix.split("\n\n", 1)[0] if prefix.startswith(RULES_MARKER) else ""
        shown = {t for t in ALL_TYPES if f"For {t} tasks" in block}
        if scope == "type":  # only its own type's rule, if it got one
            assert shown == ({task_type} & set(GATHER_TYPES))
        else:
            assert shown == set(GATHER_TYPES)
    with RunReader(tmp_path / "insights") as store:
        manifest = store.get_meta("manifest")
    assert manifest["experience"] == {
        "run": str(gathered),
        "split": "train",
        "digest": load(gathered).provenance.digest,
    }


def test_a_run_on_the_gathered_games_is_refused(
    gathered: Path, train_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its own games' episodes (same split, same files): exit 2, one line naming the source,
    nothing written."""
    run_dir = tmp_path / "leak"
    code = main([
        "run", "--data", str(train_games), "--split", "train", "--agent", "insights",
        "--model", "scripted:ruled", "--experience-from", str(gathered), "--run-dir", str(run_dir),
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and str(gathered) in err[0] and "train" in err[0]
    assert not run_dir.exists()


def test_the_same_game_files_in_another_split_are_refused(
    gathered: Path, train_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy of a gathered game under the evaluation split is still that game (file hash)."""
    data = tmp_path / "data"
    shutil.copytree(train_games / "json_2.1.1" / "train", data / "json_2.1.1" / "valid_unseen")
    run_dir = tmp_path / "copy"
    code = main([
        "run", "--data", str(data), "--split", "eval_out_of_distribution", "--agent", "insights",
        "--model", "scripted:ruled", "--experience-from", str(gathered), "--run-dir", str(run_dir),
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and str(gathered) in err[0] and "game(s) this run plays" in err[0]
    assert not run_dir.exists()


def test_the_insights_arm_without_experience_is_refused(
    generated_games: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "run", "--data", str(generated_games), "--split", "eval_out_of_distribution",
        "--agent", "insights", "--model", "scripted:ruled", "--run-dir", str(tmp_path / "x"),
    ])  # fmt: skip
    assert code == 2
    assert "--experience-from" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_attempt_task_is_the_task_line() -> None:
    a = Attempt("g", "heat", 0, True, "You are in a room.\n\nYour task is to: heat an egg.", ())
    assert a.task == "heat an egg."
