"""Grounded decoding without a model: the grammar builders agree with the constraint, the token
masks only ever lead to allowed texts, ``nearest`` never raises, and every backend either takes
a constraint to its engine (here: a real local HTTP server) or refuses it in one line."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.llm import CallSite, GenerationConfig, Request, SpecError, make_backend
from agents.llm.base import ActionConstraint, BackendError
from agents.llm.common import check_grounding
from agents.llm.ground_truth import Walkthroughs
from agents.llm.grounding import (
    THINK,
    TokenGrammar,
    command_features,
    gbnf_for,
    is_complete,
    nearest_action,
    regex_for,
    similarity,
    viable_prefix,
)
from tests.support.fault_server import FaultServer

ACTIONS = (
    "go to desk 1",
    "go to desk 10",
    "take mug 1 from countertop 2",
    "take mug 2 from countertop 1",
    "look",
)
ACT = GenerationConfig(max_tokens=20, stop=("\n",))

line = st.text(st.characters(blacklist_characters="\n"), min_size=1, max_size=30)
# what a command can hold: one line of printable text (no control or line-separator characters)
command = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=30)
constraints = st.builds(
    ActionConstraint,
    actions=st.lists(line, min_size=1, max_size=6).map(tuple),
    allow_think=st.booleans(),
    lead=st.sampled_from([" ", "", "> "]),
)


# -- the builders and the checker agree -----------------------------------------------------------
def test_grammar_texts() -> None:
    c = ActionConstraint(("go to desk 1", 'say "hi" \\ now'))
    assert gbnf_for(c) == (
        'root ::= " " (action | think) "\\n"?\n'
        'action ::= "go to desk 1" | "say \\"hi\\" \\\\ now"\n'
        'think ::= "think: " [^\\n]+\n'
    )
    assert regex_for(c) == ' (go to desk 1|say "hi" \\\\ now|think: [^\\n]+)\\n?'
    only = ActionConstraint(("look",), allow_think=False)
    assert gbnf_for(only, newline=False) == 'root ::= " " (action)\naction ::= "look"\n'
    assert regex_for(only, newline=False) == " (look)"
    assert "action" not in gbnf_for(ActionConstraint((), allow_think=True))


@settings(max_examples=200, deadline=None)
@given(c=constraints, text=st.text(max_size=40), newline=st.booleans())
def test_regex_matches_exactly_the_allowed_completions(
    c: ActionConstraint, text: str, newline: bool
) -> None:
    pattern = re.compile(regex_for(c, newline=newline), re.DOTALL)
    for action in c.actions:
        assert pattern.fullmatch(c.lead + action)
        assert bool(pattern.fullmatch(c.lead + action + "\n")) == newline
    assert bool(pattern.fullmatch(c.lead + THINK + "plan")) == c.allow_think
    for candidate in (text, c.lead + text, c.lead + THINK + text):
        assert bool(pattern.fullmatch(candidate)) == is_complete(c, candidate, newline=newline)
        if is_complete(c, candidate, newline=newline):
            assert viable_prefix(c, candidate, newline=newline)


def test_viable_prefix() -> None:
    c = ActionConstraint(ACTIONS)
    assert all(viable_prefix(c, p) for p in ("", " ", " go to desk 1", " go to desk 10\n"))
    assert all(viable_prefix(c, p) for p in (" th", " think: ", " think: a b"))
    assert not any(viable_prefix(c, p) for p in ("go", " go to desk 2", " think: a\nb", " lo\n"))
    assert not viable_prefix(ActionConstraint(ACTIONS, allow_think=False), " th")


# -- token masks ------------------------------------------------------------------------------------
VOCAB = [" ", "go", " go", " to", " desk", " 1", "0", "\n", " th", "ink", ":", " take", " mug",
         " 2", " from", " countertop", "x", "x\n", " look", "think: ", " lo", "ok", None, "\n\n"]  # fmt: skip
VOCAB += sorted(set("".join(ACTIONS) + THINK) - set(VOCAB))  # like real vocabularies: every char
EOS = len(VOCAB)


@settings(max_examples=200, deadline=None)
@given(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=30), allow=st.booleans())
def test_token_walks_stay_inside_the_constraint(picks: list[int], allow: bool) -> None:
    grammar = TokenGrammar([*VOCAB, None], [EOS])
    c = ActionConstraint(ACTIONS, allow_think=allow)
    text = ""
    for pick in picks:
        allowed = grammar.allowed(c, text)
        assert allowed, text  # never a dead end: every action is spelled by the toy vocabulary
        token = allowed[pick % len(allowed)]
        if token == EOS:
            assert is_complete(c, text)
            return
        text += grammar.texts[token] or ""
        assert viable_prefix(c, text), text
    assert viable_prefix(c, text)


def test_token_masks_by_state() -> None:
    grammar = TokenGrammar([*VOCAB, None], [EOS])
    c = ActionConstraint(ACTIONS)

    def words(text: str) -> set[str | None]:
        return {VOCAB[i] if i < EOS else "<eos>" for i in grammar.allowed(c, text)}

    assert words("") == {" ", " go", " th", " take", " lo", " look"}
    assert words(" go") == {" ", " to"}
    assert words(" go to desk 1") == {"0", "\n", "<eos>"}
    assert words(" go to desk 10\n") == {"<eos>"}
    assert words(" think: ") >= {"x", "x\n", " go"} and "\n" not in words(" think: ")
    assert {"\n", "x\n", "<eos>"} <= words(" think: x") and "\n\n" not in words(" think: x")
    assert words(" go to desk 2") == set()


# -- nearest ----------------------------------------------------------------------------------------
def test_nearest_examples() -> None:
    assert nearest_action(" take mug 1 from countertop 2", ACTIONS) == ACTIONS[2]
    assert nearest_action("take mug 2 from countertop 1\n> look", ACTIONS) == ACTIONS[3]
    assert nearest_action("> Go to desk 10.", ACTIONS) == "go to desk 10"
    assert nearest_action("go to the desk", ACTIONS) == "go to desk 1"  # tie: the first
    assert nearest_action("walk to desk 10 now", ACTIONS) == "go to desk 10"
    assert nearest_action(" think:   I need  a mug\nmore", ACTIONS) == "think: I need a mug"
    assert nearest_action(" Think: find the mug", ACTIONS, allow_think=False) == ACTIONS[2]
    assert nearest_action("", ACTIONS) == "go to desk 1"
    assert nearest_action("open drawer 1", []) == "open drawer 1"
    assert command_features("take mug 1") == {"take", "mug", "1", "mug 1"}
    assert similarity("look", "look") == 1.0 and similarity("", "") == 0.0


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(max_size=80),
    admissible=st.lists(st.text(max_size=30), max_size=8),
    allow=st.booleans(),
)
def test_nearest_never_raises_and_answers_inside(
    text: str, admissible: list[str], allow: bool
) -> None:
    out = nearest_action(text, admissible, allow_think=allow)
    assert isinstance(out, str)
    if admissible and not (allow and out.startswith(THINK)):
        assert out in admissible
    if out.startswith(THINK) and allow and out not in admissible:
        assert "\n" not in out and out.strip() == out


@settings(max_examples=200, deadline=None)
@given(admissible=st.lists(command.filter(str.strip), min_size=1, max_size=8, unique=True))
def test_nearest_returns_an_admissible_command_as_written(admissible: list[str]) -> None:
    for command in admissible:
        found = nearest_action(" " + command, admissible, allow_think=False)
        # the same command, or an earlier one equal to it up to case, spaces and a final period
        assert (
            " ".join(found.lower().split()).rstrip(".!")
            == " ".join(command.lower().split()).rstrip(".!")
            or similarity(found, command) == 1.0
        )


# -- backends that take the constraint to their engine, or refuse it ------------------------------
@pytest.fixture
def server() -> Any:
    with FaultServer(answer=lambda text: " go to desk 10") as s:
        yield s


@pytest.mark.parametrize(
    ("spec", "options", "field"),
    [
        ("vllm:m", {}, "structured_outputs"),
        ("openai:m", {"grammar_dialect": "vllm-guided"}, "guided_regex"),
        ("openai:m", {"grammar_dialect": "llamacpp"}, "grammar"),
    ],
)
def test_http_dialects_send_the_constraint(
    server: FaultServer, spec: str, options: dict[str, Any], field: str
) -> None:
    backend = make_backend(spec, base_url=server.url, **options)
    c = ActionConstraint(ACTIONS)
    (out,) = backend.generate([Request(config=ACT, prompt="You see a desk.\n>", constraint=c)])
    backend.close()
    assert out.text == " go to desk 10"
    (body,) = server.bodies
    sent = body[field]
    if field == "structured_outputs":
        assert sent == {"regex": regex_for(c)}
    else:
        assert sent == (gbnf_for(c) if field == "grammar" else regex_for(c))
    assert check_grounding(backend)


def test_a_server_that_ignores_the_constraint_is_an_error() -> None:
    with FaultServer() as server:  # answers " ok <hash>": not an admissible command
        backend = make_backend("vllm:m", base_url=server.url, max_retries=0)
        request = Request(config=ACT, prompt="x>", constraint=ActionConstraint(ACTIONS))
        with pytest.raises(BackendError, match="ignored the vllm constraint.*grammar_dialect"):
            backend.generate([request])
        backend.close()


def test_sharded_servers_pass_the_constraint_through() -> None:
    with FaultServer(answer=lambda t: " look") as a, FaultServer(answer=lambda t: " look") as b:
        backend = make_backend("vllm:m", base_url=f"{a.url},{b.url}")
        assert check_grounding(backend) == "vLLM structured outputs (regex)"
        c = ActionConstraint(ACTIONS)
        games = [f"game{i}" for i in range(6)]
        reqs = [
            Request(config=ACT, prompt="x>", constraint=c, site=CallSite(game=g)) for g in games
        ]
        assert [o.text for o in backend.generate(reqs)] == [" look"] * 6
        backend.close()
        bodies = a.bodies + b.bodies
        assert len(bodies) == 6 and all(
            x["structured_outputs"] == {"regex": regex_for(c)} for x in bodies
        )


def _one_line_nearest(exc: pytest.ExceptionInfo[SpecError]) -> None:
    message = str(exc.value)
    assert "\n" not in message and "--action-decoding nearest" in message


def test_backends_that_cannot_constrain_say_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, server: FaultServer
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key-0123456789")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-0123456789")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    request = Request(config=ACT, prompt="x>", constraint=ActionConstraint(ACTIONS))
    unknown = make_backend("openai:m", base_url=server.url)  # a server of unknown dialect
    for backend in (
        make_backend("openai:gpt-4o-mini"),
        make_backend("anthropic:claude-haiku-4-5"),
        unknown,
    ):
        with pytest.raises(SpecError) as exc:
            check_grounding(backend)
        _one_line_nearest(exc)
        with pytest.raises(SpecError) as exc:
            backend.generate([request])
        _one_line_nearest(exc)
        backend.close()
    assert server.bodies == []  # refused before anything was sent
    with pytest.raises(SpecError, match="grammar_dialect=vllm or llamacpp"):
        check_grounding(unknown)
    with pytest.raises(SpecError, match="takes no grammar"):
        make_backend("openai:gpt-4o-mini", grammar_dialect="vllm")
    with pytest.raises(SpecError, match="grammar_dialect='xml' must be one of"):
        make_backend("openai:m", base_url=server.url, grammar_dialect="xml")


# -- scripted policies pick from the constraint -----------------------------------------------------
def test_scripted_policies_pick_from_the_constraint() -> None:
    c = ActionConstraint(("go to desk 1", "take mug 1 from desk 1"), allow_think=False)
    site = CallSite(game="g", trial=0, step=3, admissible=("open fridge 1",))
    random = make_backend("scripted:random")
    outs = random.generate(
        [
            Request(config=ACT, prompt="x>", constraint=c, site=replace(site, step=s))
            for s in range(8)
        ]
    )
    assert {o.text for o in outs} <= {" go to desk 1", " take mug 1 from desk 1"}
    walkthrough = ["go to desk 1", "take mug 1 from the desk 1"]  # not written as admissible
    expert = make_backend("scripted:expert", ground_truth=Walkthroughs({"g": walkthrough}))
    ask = CallSite(game="g", history=("think: plan", "go to desk 1"), step=2)
    (out,) = expert.generate([Request(config=ACT, prompt="x>", constraint=c, site=ask)])
    assert out.text == " take mug 1 from desk 1"
    first = CallSite(game="g", step=0)  # the expert thinks first
    thinking = ActionConstraint(c.actions, allow_think=True)
    (out,) = expert.generate([Request(config=ACT, prompt="x>", constraint=thinking, site=first)])
    assert out.text.startswith(" think: ")
    (out,) = expert.generate([Request(config=ACT, prompt="x>", constraint=c, site=first)])
    assert out.text in (" go to desk 1", " take mug 1 from desk 1")
    assert check_grounding(expert)
