"""Scripted policies: the expert wins by its walkthrough, the learner switches on the memory
marker in the prompt text, random is deterministic, replay serves a recorded run."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agents.llm import BackendError, CallSite, GenerationConfig, Request, SpecError, make_backend
from agents.llm.ground_truth import Walkthroughs
from agents.llm.markers import MEMORY_MARKER

GAME = "pick_clean/trial_1"
WALKTHROUGH = [
    "go to countertop 1",
    "take mug 1 from countertop 1",
    "go to sinkbasin 1",
    "clean mug 1 with sinkbasin 1",
    "go to coffeemachine 1",
    "move mug 1 to coffeemachine 1",
]
TRUTH = Walkthroughs({GAME: WALKTHROUGH})
PROMPT = "Interact with a household to solve a task.\n...\nYour task is to: clean a mug.\n>"
CFG = GenerationConfig()


def _request(prompt: str, site: CallSite, purpose: str = "act") -> Request:
    return Request(config=CFG, prompt=prompt, purpose=purpose, site=site)  # type: ignore[arg-type]


def play(backend: Any, prompt: str, game: str = GAME, limit: int = 20) -> list[str]:
    """Run the policy as the rollout would: parse the first line, strip, feed history back."""
    walkthrough = TRUTH.walkthrough(game) or []
    history: list[str] = []
    for step in range(limit):
        site = CallSite(
            game=game, trial=0, step=step, admissible=("look", "inventory", *WALKTHROUGH),
            history=tuple(history),
        )  # fmt: skip
        text = backend.generate([_request(prompt, site)])[0].text
        assert text.startswith(" ") and "\n" not in text  # what a model writes after ">"
        history.append(text.splitlines()[0].strip())
        executed = [h for h in history if not h.startswith("think:")]
        if executed == walkthrough[: len(executed)] and len(executed) == len(walkthrough):
            break
    return history


def test_expert_plays_the_walkthrough_with_one_thought_first() -> None:
    expert = make_backend("scripted:expert", ground_truth=TRUTH)
    history = play(expert, PROMPT)
    assert history[0].startswith("think:")
    assert [h for h in history if not h.startswith("think:")] == WALKTHROUGH
    assert len(history) == len(WALKTHROUGH) + 1


def test_expert_without_walkthrough_looks() -> None:
    site = CallSite(game="g", trial=0, step=3, history=("look",) * 3)
    no_truth = make_backend("scripted:expert")
    assert no_truth.generate([_request(PROMPT, site)])[0].text == " look"
    unknown_game = make_backend("scripted:expert", ground_truth=TRUTH)
    assert unknown_game.generate([_request(PROMPT, site)])[0].text == " look"


def test_expert_judges_with_the_game_s_walkthrough_and_writes_a_plan() -> None:
    """Answers depend on the request and the ground truth alone: a backend that saw the game
    played and a fresh one (a resumed run's) judge and reflect alike."""
    seen = make_backend("scripted:expert", ground_truth=TRUTH)
    play(seen, PROMPT)
    won = ("think: plan", *WALKTHROUGH)
    judge_ok = _request("transcript", CallSite(game=GAME, history=won), "judge")
    judge_bad = _request("transcript", CallSite(game=GAME, history=tuple(WALKTHROUGH[:2])), "judge")
    reflect = _request("reflect on it", CallSite(game=GAME, trial=0), "reflect")
    requests = [judge_ok, judge_bad, Request(**_plain(reflect))]
    ok, bad, plan = seen.generate(requests)
    assert ok.text.startswith("SUCCESS")
    assert bad.text.startswith("FAILURE")
    assert "take mug 1 from countertop 1" in plan.text
    fresh = make_backend("scripted:expert", ground_truth=TRUTH)
    assert [c.text for c in fresh.generate(requests)] == [ok.text, bad.text, plan.text]


def _plain(r: Request) -> dict[str, Any]:
    # a reflection request has no stop at newline: the plan may be long
    return {
        "config": GenerationConfig(max_tokens=256, stop=()),
        "prompt": r.prompt,
        "purpose": r.purpose,
        "site": r.site,
    }


def test_learner_repeats_until_its_prompt_holds_a_memory_block() -> None:
    learner = make_backend("scripted:learner", ground_truth=TRUTH)
    first = play(learner, PROMPT, limit=5)
    assert first == ["look"] * 5  # a loop the evaluator will call a failure
    with_memory = PROMPT.replace(
        "Your task", f"{MEMORY_MARKER}\n- I looked around forever.\n\nYour task"
    )
    second = play(learner, with_memory)
    assert [h for h in second if not h.startswith("think:")] == WALKTHROUGH


def test_learner_reads_memory_from_the_prompt_text_only() -> None:
    learner = make_backend("scripted:learner", ground_truth=TRUTH)
    site = CallSite(game=GAME, trial=3, step=1, history=("look",))  # a later trial, no marker
    assert learner.generate([_request(PROMPT, site)])[0].text == " look"


def test_random_is_deterministic_and_admissible() -> None:
    a, b = make_backend("scripted:random"), make_backend("scripted:random")
    admissible = tuple(f"go to drawer {i}" for i in range(30))

    def ask(backend: Any, step: int, seed: int = 0, game: str = "g") -> str:
        site = CallSite(game=game, trial=0, step=step, admissible=admissible)
        req = Request(config=GenerationConfig(seed=seed), prompt=PROMPT, site=site)
        return str(backend.generate([req])[0].text.strip())

    run_a = [ask(a, s) for s in range(20)]
    assert run_a == [ask(b, s) for s in range(20)]
    assert all(x in admissible for x in run_a)
    assert len(set(run_a)) > 5
    assert run_a != [ask(a, s, seed=1) for s in range(20)]
    assert run_a != [ask(a, s, game="h") for s in range(20)]


def test_scripted_counts_words_and_honours_stop() -> None:
    expert = make_backend("scripted:expert", ground_truth=Walkthroughs({"g": ["look"]}))
    site = CallSite(game="g", trial=0, step=1, history=("think: x",))
    c = expert.generate([_request("one two three >", site)])[0]
    assert c.prompt_tokens == 4 and c.completion_tokens == 1
    assert expert.describe() == {
        "spec": "scripted:expert",
        "backend": "scripted",
        "policy": "expert",
    }


# -- replay --------------------------------------------------------------------------------------
def _make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run1"
    run.mkdir()
    conn = sqlite3.connect(run / "run.sqlite")
    conn.executescript(
        """
        CREATE TABLE episodes (episode_id TEXT PRIMARY KEY, game TEXT, trial INT, arm TEXT,
                               judge_verdict TEXT, judge_reason TEXT);
        CREATE TABLE steps (episode_id TEXT, idx INT, raw_output TEXT, action TEXT);
        CREATE TABLE reflections (task TEXT, trial INT, text TEXT);
        """
    )
    conn.executemany(
        "INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?)",
        [
            ("e1", "g/1", 0, "reflexion", "FAILURE", "looped"),
            ("e2", "g/1", 1, "reflexion", None, None),
            ("e3", "g/1", 1, "baseline", None, None),
        ],
    )
    conn.executemany(
        "INSERT INTO steps VALUES (?, ?, ?, ?)",
        [
            ("e1", 0, " look", "look"),
            ("e1", 1, " look", "look"),
            ("e2", 0, " go to desk 1", "go to desk 1"),
            ("e2", 1, " take pen 1 from desk 1\n", "take pen 1 from desk 1"),
            ("e3", 0, " inventory", "inventory"),
        ],
    )
    conn.execute("INSERT INTO reflections VALUES ('g/1', 0, 'Next time go to the desk.')")
    conn.commit()
    conn.close()
    return run


def test_replay_serves_recorded_outputs(tmp_path: Path) -> None:
    run = _make_run(tmp_path)
    replay = make_backend(f"scripted:replay:{run}", arm="reflexion")
    reqs = [
        _request(PROMPT, CallSite(game="g/1", trial=1, step=0)),
        _request(PROMPT, CallSite(game="g/1", trial=1, step=1)),
        _request(PROMPT, CallSite(game="g/1", trial=0, step=1)),
        Request(**_plain(_request("r", CallSite(game="g/1", trial=0), "reflect"))),
        _request("j", CallSite(game="g/1", trial=0), "judge"),
    ]
    texts = [c.text for c in replay.generate(reqs)]
    assert texts == [
        " go to desk 1",
        " take pen 1 from desk 1",  # cut at the stop, as a model's would be
        " look",
        "Next time go to the desk.",
        "FAILURE looped",
    ]
    baseline = make_backend(f"scripted:replay:{run}", arm="baseline")
    assert baseline.generate(reqs[:1])[0].text == " inventory"
    with pytest.raises(BackendError, match="nothing recorded for act of game 'g/1' trial 1 step 7"):
        replay.generate([_request(PROMPT, CallSite(game="g/1", trial=1, step=7))])
    replay.close()


def test_replay_opens_the_store_read_only(tmp_path: Path) -> None:
    run = _make_run(tmp_path)
    replay = make_backend(f"scripted:replay:{run}")
    assert replay._db is not None
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        replay._db.execute("DELETE FROM steps")
    replay.close()


def test_replay_of_a_missing_run_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no run store at"):
        make_backend(f"scripted:replay:{tmp_path / 'nope'}")


@pytest.mark.parametrize("chat_format", ["raw", "user", "prefill"])
def test_a_policy_sends_what_a_model_would_get(chat_format: str) -> None:
    """``sent`` holds the prompt, or the messages a chat backend wraps it in; the record made of
    it (``sent_request``) is that, with the sampling settings and no key."""
    from agents.llm.common import prompt_as_messages, sent_request

    backend = make_backend("scripted:expert", ground_truth=TRUTH, chat_format=chat_format)
    request = _request(PROMPT, CallSite(game=GAME, trial=0, step=1))
    (answer,) = backend.generate([request])
    record = sent_request(request, answer.sent)
    if chat_format == "raw":
        assert record.prompt == PROMPT and record.messages is None
    else:
        assert record.chat == prompt_as_messages(PROMPT, chat_format)
    assert record.params["sampling"]["stop"] == ["\n"]
    keyed = {"prompt": PROMPT, "extra_headers": {"Authorization": "Bearer sk-x"},
             "extra_body": {"api_key": "sk-x", "top_k": 5}, "temperature": 0.0}  # fmt: skip
    kept = sent_request(request, keyed)
    assert "sk-x" not in repr(kept) and kept.params["extra_body"] == {"top_k": 5}
    with pytest.raises(SpecError, match="chat_format"):
        make_backend("scripted:expert", chat_format="json")
