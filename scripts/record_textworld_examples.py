"""Record the TextWorld few-shot examples by playing freshly generated games through the env.

Generates each example's game with ``envs.twgen`` (deterministic given challenge, seed and
options), plays its walkthrough through ``envs.TextWorldEnv`` with a few ``think:`` lines, and
writes ``agents/prompts/examples/textworld.json``. Re-run after any change to the observation
pipeline or the generator (about 10-30 s):

    python scripts/record_textworld_examples.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.textworld_env import TextWorldEnv, game_walkthrough
from envs.twgen import generate_textworld_games

OUT = Path(__file__).resolve().parent.parent / "agents" / "prompts" / "examples" / "textworld.json"
THOUGHT_OBSERVATION = "OK."


@dataclass(frozen=True)
class ExampleSpec:
    challenge: str
    seed: int
    options: dict[str, Any]
    walkthrough: list[str]  # what the generated game's walkthrough must be for the thoughts to hold
    thoughts: dict[int, str] = field(default_factory=dict)  # walkthrough index -> thought before it

    @property
    def folder(self) -> str:
        return f"{self.challenge}-seed{self.seed}"

    def describe(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        return (
            f"generate_textworld_games(n=1, seed={self.seed}, challenge={self.challenge!r}{opts})"
        )


EXAMPLES: list[ExampleSpec] = [
    ExampleSpec(
        "tw-simple",
        11,
        {"goal": "brief"},
        [
            "open chest drawer",
            "take old key from chest drawer",
            "unlock wooden door with old key",
            "open wooden door",
            "go east",
            "open refrigerator",
            "take tomato plant from refrigerator",
            "put tomato plant on stove",
        ],
        {
            0: "think: To grill the tomato plant, I need to find it and put it on the stove. The "
            "stove is likely in the kitchen, but the wooden door east is closed. First I look for a "
            "key in the chest drawer and the antique trunk.",
            5: "think: This is the kitchen and the stove is here. The tomato plant is food, so it "
            "may be in the closed refrigerator.",
        },
    ),
    ExampleSpec(
        "tw-cooking",
        12,
        {"go": 6, "open": True, "cook": True},
        [
            "inventory",
            "go west",
            "examine cookbook",
            "take purple potato from counter",
            "cook purple potato with stove",
            "prepare meal",
            "eat meal",
        ],
        {
            1: "think: To cook the meal, I need to read the cookbook in the kitchen. This is the "
            "livingroom, with exits south and west; I will try west.",
            3: "think: The recipe needs the purple potato sliced and fried. The purple potato on the "
            "counter is already sliced, so I take it and fry it with the stove.",
        },
    ),
]


def generate_example_games(out_dir: Path) -> list[Path]:
    """Generate each example's game into ``out_dir/<challenge>-seed<seed>/``."""
    return [
        generate_textworld_games(out_dir / s.folder, 1, s.seed, s.challenge, **s.options)[0]
        for s in EXAMPLES
    ]


def record(game_files: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Play each example's walkthrough with its thoughts; the transcripts in the file's format."""
    examples = []
    for spec, game_file in zip(EXAMPLES, game_files, strict=True):
        walkthrough = game_walkthrough(game_file)
        if walkthrough != spec.walkthrough:
            raise SystemExit(
                f"{spec.describe()} now has walkthrough {walkthrough}: "
                "update EXAMPLES (the thoughts refer to the old game)"
            )
        env = TextWorldEnv(game_file=game_file)
        obs, info = env.reset(seed=0)
        steps: list[dict[str, str]] = []
        won = False
        for i, action in enumerate(spec.walkthrough):
            if i in spec.thoughts:
                steps.append({"action": spec.thoughts[i], "observation": THOUGHT_OBSERVATION})
            observation, _, _, _, info = env.step(action)
            steps.append({"action": action, "observation": observation})
            won = bool(info["won"])
        env.close()
        if not won:
            raise SystemExit(f"the walkthrough of {spec.describe()} did not win")
        examples.append({"game": spec.describe(), "observation": obs, "steps": steps})
    return {"textworld": examples}


def render(examples: dict[str, list[dict[str, Any]]]) -> str:
    return json.dumps(examples, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=OUT, help="where to write (default: %(default)s)"
    )
    parser.add_argument("--games", type=Path, default=None, help="keep the generated games here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tw-examples-") as tmp:
        games_dir = args.games or Path(tmp)
        text = render(record(generate_example_games(games_dir)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {len(EXAMPLES)} examples to {args.out}")


if __name__ == "__main__":
    main()
