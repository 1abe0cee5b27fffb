"""Real ALFWorld episodes played under grounded decoding, for the backend tests.

Each episode runs on its own :class:`~envs.alfworld_env.ALFWorldEnv`; every tick the live
episodes' actor prompts (``agents.prompting.actor_prompt`` with one packaged example of the
game's task type) go to the model as one batch, each with an ``ActionConstraint`` holding the
game's current admissible commands. A thought is answered ``OK.`` without stepping the game.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agents.llm.base import ActionConstraint, Completion, GenerationConfig, Request
from agents.prompting import actor_prefix, actor_prompt, example_texts

# commands that test a grammar's escaping: quotes, backslashes, non-ASCII, a tab, regex syntax
NASTY = (
    'say "hi"',
    "path a\\b\\",
    "emoji \u00e9t\u00e9 \u2603",
    "tab\there",
    'q"\\"q',
    "a.b*c+d?(e)[f]{g}|h^i$j",
)
ACTOR = GenerationConfig(temperature=0.0, max_tokens=40, stop=("\n",), seed=0)


@dataclass(frozen=True)
class GroundedStep:
    game: str
    step: int
    admissible: tuple[str, ...]
    text: str
    finish_reason: str
    prompt_tokens: int

    @property
    def allowed(self) -> bool:
        """The text is the lead and one admissible command, or the lead and a thought line."""
        body = self.text[1:] if self.text.startswith(" ") else None
        if body is None or "\n" in body:
            return False
        return body in self.admissible or (body.startswith("think: ") and len(body) > 7)


GAMES = 2  # the first two generated games: two task types, two grammars each step


def assert_grounded(steps: Sequence[GroundedStep], episodes: int = GAMES, each: int = 2) -> None:
    """Every answer of every episode (at least ``each`` per episode) was an admissible command
    or a thought (100%)."""
    assert len({s.game for s in steps}) == episodes and len(steps) >= each * episodes
    bad = [(s.text, s.admissible[:5]) for s in steps if not s.allowed]
    assert not bad, bad
    # a command always ends by itself (the grammar leaves nothing else); a thought may run long
    assert all(s.finish_reason == "stop" for s in steps if not s.text.startswith(" think:"))


def play(
    generate: Callable[[list[Request]], Sequence[Completion]],
    data_dir: Path,
    games: int = GAMES,
    steps: int = 3,
    split: str = "eval_out_of_distribution",
) -> list[GroundedStep]:
    """Play ``games`` episodes of up to ``steps`` model calls each; every answer recorded."""
    from envs.alfworld_env import ALFWorldEnv  # the game engine, only where a test plays

    probe = ALFWorldEnv(data_dir=data_dir, split=split)
    ids = probe.game_ids[:games]
    probe.close()
    envs = [ALFWorldEnv(data_dir=data_dir, split=split, games=[g]) for g in ids]
    state = []
    for env, game in zip(envs, ids, strict=True):
        obs, info = env.reset(options={"game": game})
        # one example of the game's task type, not the run's two: what is checked (every
        # answer admissible) does not depend on the prompt's length, and the prompt is most of
        # a CPU model's time
        prefix = actor_prefix(example_texts(info["task_type"])[:1])
        state.append({"prefix": prefix, "obs": obs, "history": [], "info": info, "done": False})
    record: list[GroundedStep] = []
    for step in range(steps):
        live = [i for i, s in enumerate(state) if not s["done"]]
        if not live:
            break
        requests = []
        for i in live:
            s = state[i]
            constraint = ActionConstraint(tuple(s["info"]["admissible_commands"]))
            prompt = actor_prompt(s["prefix"], s["obs"], s["history"])
            requests.append(Request(config=ACTOR, prompt=prompt, constraint=constraint))
        answers = generate(requests)
        for i, request, answer in zip(live, requests, answers, strict=True):
            s = state[i]
            assert request.constraint is not None
            record.append(
                GroundedStep(
                    game=ids[i],
                    step=step,
                    admissible=request.constraint.actions,
                    text=answer.text,
                    finish_reason=answer.finish_reason,
                    prompt_tokens=answer.prompt_tokens,
                )
            )
            action = answer.text.strip()
            if action.startswith("think:"):
                s["history"].append((action, "OK."))
                continue
            obs, _, won, truncated, info = envs[i].step(action)
            s["history"].append((action, obs))
            s["info"] = info
            s["done"] = won or truncated
    for env in envs:
        env.close()
    return record
