from agents.evaluators import CodeEvaluator, PaperEvaluator, classify_failure, make_evaluator
from memory.records import FailureClass, Step


def step(i, action, obs="Nothing happens.", kind="act", admissible=True):
    return Step(
        index=i,
        kind=kind,
        raw_output=" " + action,
        action=action,
        observation=obs,
        admissible=admissible,
    )


def run(ev, steps):
    """The first index at which the evaluator stops the episode, or None."""
    for i in range(1, len(steps) + 1):
        v = ev.check(steps[:i])
        if v is not None:
            return i, v
    return None


def test_paper_three_repeats_pass_four_fail():
    ev = PaperEvaluator()
    three = [step(0, "go to desk 1", "You arrive")] + [
        step(i, "open drawer 1") for i in range(1, 4)
    ]
    assert run(ev, three) is None
    four = three + [step(4, "open drawer 1")]
    i, v = run(ev, four)
    assert i == 5 and v.failure_class == FailureClass.REPEATED_ACTION.value


def test_paper_same_action_different_observation_is_not_a_loop():
    ev = PaperEvaluator()
    steps = [step(i, "look", f"obs {i}") for i in range(6)]
    assert run(ev, steps) is None


def test_paper_30_actions_pass_31_fail():
    ev = PaperEvaluator()
    thirty = [step(i, f"go to drawer {i}", f"obs {i}") for i in range(30)]
    assert run(ev, thirty) is None
    i, v = run(ev, thirty + [step(30, "go to drawer 30", "obs 30")])
    assert i == 31 and v.failure_class == FailureClass.TOO_LONG.value


def test_paper_thoughts_count_only_when_asked():
    steps = [step(i, f"think: t{i}", "OK.", kind="think") for i in range(20)]
    steps += [step(20 + i, f"go to drawer {i}", f"obs {i}") for i in range(15)]
    assert run(PaperEvaluator(count_thoughts=True), steps) is not None
    assert run(PaperEvaluator(count_thoughts=False), steps) is None


def test_code_two_identical_in_a_row():
    ev = CodeEvaluator()
    assert run(ev, [step(0, "go to desk 1", "a"), step(1, "go to bed 1", "b")]) is None
    i, v = run(ev, [step(0, "go to desk 1", "a"), step(1, "go to desk 1", "a")])
    assert i == 2 and v.failure_class == FailureClass.REPEATED_ACTION.value


def test_code_two_identical_thoughts_fail():
    ev = CodeEvaluator()
    t = [
        step(0, "think: I need a mug.", "OK.", "think"),
        step(1, "think: I need a mug.", "OK.", "think"),
    ]
    assert run(ev, t)[0] == 2
    # the paper evaluator lets the same pair go three times
    assert run(PaperEvaluator(), t) is None


def test_llm_evaluator_never_stops_early():
    ev = make_evaluator("llm")
    assert run(ev, [step(i, "look", "x") for i in range(10)]) is None


def test_failure_classes():
    loop = [step(i, "look") for i in range(5)]
    v = PaperEvaluator().check(loop)
    assert classify_failure(loop, v, truncated=False) == "repeated_action"
    bad = [step(i, f"fly {i}", admissible=False) for i in range(5)]
    assert classify_failure(bad, None, truncated=True) == "invalid_actions"
    ok = [step(i, f"go to drawer {i}", f"o{i}") for i in range(5)]
    assert classify_failure(ok, None, truncated=True) == "step_cap"
