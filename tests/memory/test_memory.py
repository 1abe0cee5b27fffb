import dataclasses

import pytest

from agents.explore import extract_facts
from memory import ExplorationFact, Reflection, Step, TaskMemory
from memory.records import ModelCall, SentRequest


def refl(trial, task="g"):
    return Reflection(
        task=task,
        trial=trial,
        episode_id=f"{task}#t{trial}",
        model="m",
        prompt_hash="h",
        text=f"plan {trial}",
    )


def test_window_shows_last_omega_and_keeps_all():
    m = TaskMemory("g", size=3)
    for t in range(5):
        m.add(refl(t))
        assert len(m.visible()) <= 3
    assert [r.trial for r in m.visible()] == [2, 3, 4]
    assert len(m.reflections) == 5


def test_window_zero_and_wrong_task():
    m = TaskMemory("g", size=0)
    m.add(refl(0))
    assert m.visible() == []
    with pytest.raises(ValueError):
        m.add(refl(1, task="other"))


def test_records_round_trip():
    s = Step(index=0, kind="act", raw_output=" go", action="go", observation="o")
    assert Step.from_dict(s.to_dict()) == s
    f = ExplorationFact(place="drawer 1", contents=("pen 1",), trial=0)
    assert ExplorationFact.from_dict(f.to_dict()) == f
    with pytest.raises(ValueError):
        Step.from_dict({**s.to_dict(), "bogus": 1})


def test_to_dict_is_asdicts_answer():
    """``to_dict`` skips ``asdict``'s deep copy, and gives the same: a nested record as its dict,
    tuples kept as tuples, a dict's values converted."""
    sent = SentRequest(messages=(("user", "hi"), ("assistant", "ok")), params={"stop": ["\n"]})
    call = ModelCall(
        purpose="act", game="g", trial=1, sent=sent, alternatives=("a", "b"), step=3, id=7
    )
    for record in (call, SentRequest(prompt="p"), Step(0, "act", "x", "x", "o", won=True)):
        assert record.to_dict() == dataclasses.asdict(record)
    as_dict = call.to_dict()
    assert as_dict["sent"]["messages"] == (("user", "hi"), ("assistant", "ok"))
    assert isinstance(as_dict["alternatives"], tuple)


def test_exploration_facts_from_observations():
    steps = [
        Step(0, "act", "", "go to drawer 1", "You arrive at drawer 1. The drawer 1 is closed."),
        Step(
            1,
            "act",
            "",
            "open drawer 1",
            "You open the drawer 1. The drawer 1 is open. In it, you see a cd 1, and a pen 2.",
        ),
        Step(
            2, "act", "", "go to shelf 1", "You arrive at shelf 1. On the shelf 1, you see nothing."
        ),
        Step(3, "think", "", "think: hmm", "OK."),
        Step(
            4,
            "act",
            "",
            "go to desk 1",
            "You arrive at desk 1. On the desk 1, you see a alarmclock 1, a bowl 2, and a desklamp 1.",
        ),
    ]
    facts = {f.place: f for f in extract_facts(steps, trial=0)}
    assert facts["drawer 1"].contents == ("cd 1", "pen 2") and facts["drawer 1"].opened
    assert facts["shelf 1"].contents == ()
    assert facts["desk 1"].contents == ("alarmclock 1", "bowl 2", "desklamp 1")
    assert set(facts) == {"drawer 1", "shelf 1", "desk 1"}
