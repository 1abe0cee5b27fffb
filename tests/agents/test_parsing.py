from hypothesis import given
from hypothesis import strategies as st

from agents.parsing import GroundingRules, parse_action
from memory.records import StepKind


def test_first_line_stripped():
    p = parse_action("  go to desk 1  \nYou arrive at desk 1.")
    assert p.kind == StepKind.ACT
    assert p.action == "go to desk 1"


def test_think_is_a_thought():
    p = parse_action(" think: First I need to find a mug.")
    assert p.kind == StepKind.THINK
    assert p.action == "think: First I need to find a mug."


def test_put_becomes_move_and_raw_is_kept():
    raw = " put mug 1 in/on coffeemachine 1"
    p = parse_action(raw)
    assert p.action == "move mug 1 to coffeemachine 1"
    assert p.raw == raw
    assert "put_to_move" in p.rules
    assert parse_action("put apple 2 on countertop 1").action == "move apple 2 to countertop 1"
    assert parse_action("put apple 2 in fridge 1").action == "move apple 2 to fridge 1"


def test_rules_can_be_switched_off():
    p = parse_action("Put Mug 1 in/on Desk 1", GroundingRules.none())
    assert p.action == "Put Mug 1 in/on Desk 1"
    assert p.rules == ()


def test_case_and_stray_prompt_mark():
    p = parse_action("> Go To Desk 1")
    assert p.action == "go to desk 1"
    assert set(p.rules) == {"strip_prompt_marks", "lowercase"}


def test_empty_is_invalid():
    for raw in ("", "   ", "\n\n", ">", "> "):
        assert parse_action(raw).kind == StepKind.INVALID


@given(st.text())
def test_no_string_crashes_the_parser(raw):
    p = parse_action(raw)
    assert p.kind in (StepKind.ACT, StepKind.THINK, StepKind.INVALID)
    assert "\n" not in p.action
    assert p.raw == raw


@given(st.text(), st.booleans(), st.booleans(), st.booleans())
def test_no_string_crashes_any_rule_set(raw, a, b, c):
    p = parse_action(raw, GroundingRules(put_to_move=a, lowercase=b, strip_prompt_marks=c))
    assert isinstance(p.action, str)


def test_a_step_is_mapped_only_when_the_command_is_not_the_model_s_own() -> None:
    from agents.parsing import was_mapped

    assert not was_mapped(" go to desk 1\n", "go to desk 1")
    assert not was_mapped("> Put apple 2 in fridge 1", "move apple 2 to fridge 1")  # the rules
    assert was_mapped(" walk over to the desk", "go to desk 1")  # nearest decoding chose it
    assert not was_mapped("", "")
