"""Record the ALFWorld few-shot examples by playing train games through the project's env.

The observations in the examples come from ``envs.ALFWorldEnv`` itself, so the examples and live
play can never drift apart. Re-run after any change to the observation pipeline:

    python scripts/record_alfworld_examples.py --data ../shared/alfworld_data
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from envs.alfworld_env import ALFWorldEnv

OUT = Path(__file__).resolve().parent.parent / "agents" / "prompts" / "examples" / "alfworld.json"

# (task type, game folder, places searched before the object is found, the plan's actions).
# Only train games: never evaluation games.
SPECS: list[tuple[str, str, list[str], list[str]]] = [
    (
        "put",
        "pick_and_place_simple-Book-None-Cabinet-310",
        ["drawer 1", "sidetable 1"],
        [
            "go to bed 1",
            "take book 1 from bed 1",
            "go to cabinet 4",
            "open cabinet 4",
            "move book 1 to cabinet 4",
        ],
    ),
    (
        "put",
        "pick_and_place_simple-CellPhone-None-ArmChair-321",
        ["sidetable 1", "bed 1"],
        [
            "go to diningtable 1",
            "take cellphone 2 from diningtable 1",
            "go to armchair 1",
            "move cellphone 2 to armchair 1",
        ],
    ),
    (
        "clean",
        "pick_clean_then_place_in_recep-Apple-None-DiningTable-19",
        ["countertop 1", "fridge 1"],
        [
            "go to microwave 1",
            "open microwave 1",
            "take apple 1 from microwave 1",
            "go to sinkbasin 1",
            "clean apple 1 with sinkbasin 1",
            "go to diningtable 1",
            "move apple 1 to diningtable 1",
        ],
    ),
    (
        "clean",
        "pick_clean_then_place_in_recep-Cloth-None-Toilet-406",
        ["countertop 1"],
        [
            "go to bathtubbasin 1",
            "take cloth 2 from bathtubbasin 1",
            "go to sinkbasin 1",
            "clean cloth 2 with sinkbasin 1",
            "go to toilet 1",
            "move cloth 2 to toilet 1",
        ],
    ),
    (
        "heat",
        "pick_heat_then_place_in_recep-Egg-None-DiningTable-15",
        ["countertop 1", "countertop 2"],
        [
            "go to diningtable 1",
            "take egg 1 from diningtable 1",
            "go to microwave 1",
            "heat egg 1 with microwave 1",
            "go to diningtable 1",
            "move egg 1 to diningtable 1",
        ],
    ),
    (
        "heat",
        "pick_heat_then_place_in_recep-Mug-None-CoffeeMachine-22",
        ["countertop 1", "cabinet 1"],
        [
            "go to cabinet 4",
            "open cabinet 4",
            "take mug 1 from cabinet 4",
            "go to microwave 1",
            "heat mug 1 with microwave 1",
            "go to coffeemachine 1",
            "move mug 1 to coffeemachine 1",
        ],
    ),
    (
        "cool",
        "pick_cool_then_place_in_recep-Bowl-None-Microwave-19",
        ["diningtable 1"],
        [
            "go to countertop 1",
            "take bowl 1 from countertop 1",
            "go to fridge 1",
            "cool bowl 1 with fridge 1",
            "go to microwave 1",
            "open microwave 1",
            "move bowl 1 to microwave 1",
        ],
    ),
    (
        "cool",
        "pick_cool_then_place_in_recep-Bread-None-CounterTop-4",
        ["countertop 1", "countertop 2"],
        [
            "go to diningtable 1",
            "take bread 2 from diningtable 1",
            "go to fridge 1",
            "cool bread 2 with fridge 1",
            "go to countertop 1",
            "move bread 2 to countertop 1",
        ],
    ),
    (
        "examine",
        "look_at_obj_in_light-CD-None-DeskLamp-316",
        ["shelf 1", "sidetable 1"],
        ["go to desk 1", "take cd 2 from desk 1", "use desklamp 1"],
    ),
    (
        "examine",
        "look_at_obj_in_light-Pillow-None-DeskLamp-317",
        ["sidetable 1"],
        ["go to bed 1", "take pillow 2 from bed 1", "go to sidetable 1", "use desklamp 1"],
    ),
    (
        "puttwo",
        "pick_two_obj_and_place-CellPhone-None-Bed-314",
        ["desk 1"],
        [
            "go to dresser 1",
            "take cellphone 3 from dresser 1",
            "go to bed 1",
            "move cellphone 3 to bed 1",
            "go to dresser 1",
            "take cellphone 2 from dresser 1",
            "go to bed 1",
            "move cellphone 2 to bed 1",
        ],
    ),
    (
        "puttwo",
        "pick_two_obj_and_place-Candle-None-Cabinet-414",
        ["sinkbasin 1"],
        [
            "go to countertop 1",
            "take candle 3 from countertop 1",
            "go to cabinet 6",
            "open cabinet 6",
            "move candle 3 to cabinet 6",
            "go to countertop 1",
            "take candle 1 from countertop 1",
            "go to cabinet 6",
            "move candle 1 to cabinet 6",
        ],
    ),
]

_STEP_WORD = {
    "clean": "clean it with sinkbasin",
    "heat": "heat it with microwave",
    "cool": "cool it with fridge",
}


def _goal(task: str) -> tuple[str, str]:
    """(object, destination) from a task sentence; the destination is '' for examine tasks."""
    m = re.match(r"(?:look at|examine the) (\w+) (?:under|with) the desklamp", task) or re.search(
        r"(?:a|some|two) (?:clean |hot |cool )?(\w+)", task
    )
    obj = m.group(1) if m else "object"
    dest = re.search(r"(?:in|on) (\w+)\.$", task)
    return obj, dest.group(1) if dest else ""


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _plan(kind: str, obj: str, dest: str) -> str:
    if kind == "examine":
        return (
            f"To solve the task, I need to find and take {_a(obj)}, then find and use a desklamp."
        )
    if kind == "puttwo":
        return f"To solve the task, I need to find and take the first {obj}, put it in/on {dest}, then find and take the second {obj}, and put it in/on {dest}."
    middle = f", then {_STEP_WORD[kind]}" if kind in _STEP_WORD else ""
    return (
        f"To solve the task, I need to find and take {_a(obj)}{middle}, then put it in/on {dest}."
    )


def _thought_after(kind: str, action: str, obj: str, dest: str, taken: int) -> str | None:
    if action.startswith("take "):
        item = action.split(" from ")[0][5:]
        if kind == "examine":
            return f"Now I take {_a(item)}. Next, I need to find a desklamp. A desklamp is more likely to appear on a desk, sidetable or dresser."
        if kind in _STEP_WORD:
            return f"Now I take {_a(item)}. Next, I need to go to the {_STEP_WORD[kind].split()[-1]} and {kind} it."
        if kind == "puttwo" and taken == 1:
            return f"Now I take the first {obj} ({item}). Next, I need to put it in/on {dest}."
        if kind == "puttwo":
            return f"Now I take the second {obj} ({item}). Next, I need to put it in/on {dest}."
        return f"Now I take {_a(item)}. Next, I need to put it in/on {dest}."
    for verb in ("clean", "heat", "cool"):
        if action.startswith(verb + " "):
            return f"Now I {verb} the {obj}. Next, I need to put it in/on {dest}."
    if kind == "puttwo" and action.startswith("move ") and taken == 1:
        return f"Now I put the first {obj} in/on {dest}. Next, I need to find the second {obj}. I should go back to where I found the first one."
    return None


class _Recorder:
    """Plays actions through the env and keeps the transcript."""

    def __init__(self, env: ALFWorldEnv) -> None:
        self.env = env
        self.steps: list[dict[str, str]] = []
        self.won = False

    def think(self, text: str) -> None:
        self.steps.append({"action": f"think: {text}", "observation": "OK."})

    def act(self, action: str) -> str:
        observation, _, terminated, _, _ = self.env.step(action)
        self.steps.append({"action": action, "observation": observation})
        self.won = terminated
        return observation


def record(data_dir: Path) -> dict[str, list[dict[str, object]]]:
    env = ALFWorldEnv(data_dir=data_dir, split="train")
    out: dict[str, list[dict[str, object]]] = {}
    for kind, folder, search, plan in SPECS:
        (game,) = [g for g in env.game_ids if f"/{folder}/" in g]
        obs, info = env.reset(options={"game": game})
        obj, dest = _goal(info["task"])
        rec = _Recorder(env)
        think, act = rec.think, rec.act
        think(_plan(kind, obj, dest))
        places = search + [plan[0][len("go to ") :]]
        think(
            f"First I need to find {_a(obj)}. {_a(obj).capitalize()} is more likely to appear in {', '.join(places)}. I can check one by one, starting with {places[0]}."
        )
        for place in search:
            seen = act(f"go to {place}")
            if f" {obj} " in seen:
                raise SystemExit(
                    f"{folder}: {obj} already visible at {place}; pick another search place"
                )
        taken = 0
        for i, action in enumerate(plan):
            observation = act(action)
            if action.startswith("take "):
                taken += 1
            if i == 0 or (action.startswith("open ") and not plan[i + 1].startswith("move ")):
                if f"{obj} " in observation and taken == 0:
                    think(f"Now I find {_a(obj)}. Next, I need to take it.")
            after = _thought_after(kind, action, obj, dest, taken)
            if after and i + 1 < len(plan):
                think(after)
            if rec.won:
                break
        if not rec.won:
            raise SystemExit(f"{folder}: the recorded plan did not win")
        out.setdefault(kind, []).append(
            {"game": game, "observation": env.reset(options={"game": game})[0], "steps": rec.steps}
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data", type=Path, required=True, help="ALFWorld data root with a train split"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    examples = record(args.data)
    args.out.write_text(json.dumps(examples, indent=1, sort_keys=True) + "\n")
    print(f"wrote {sum(len(v) for v in examples.values())} examples to {args.out}")


if __name__ == "__main__":
    main()
