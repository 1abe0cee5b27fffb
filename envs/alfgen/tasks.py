"""Sample one ALFWorld task in one ALFRED room: what goes where, what the goal is, what it says.

Follows ALFRED's own sampling rules: object placement only where ALFRED's table allows it
(``VAL_RECEPTACLE_OBJECTS``), 1-4 instances of the target, 1-3 of the other object types the room
holds, openable receptacles closed, the goal receptacle type free of the target at the start, and
each task type only in the rooms ALFRED allows it in (``GOALS_VALID``). Task sentences are
ALFWorld's templates (``alfworld.gen.goal_library``) with a final full stop, as in its games.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs.alfgen.scenes import Receptacle, Scene, constants, make_id, pose_to_loc

LAMP = "DeskLamp"
# Where a desk lamp stands in ALFRED's rooms (it is not in the placement table: it is not
# pickupable, only toggleable).
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser", "Shelf")
# How likely an object that fits is to be found on/in a receptacle type (a room's instances share
# it, damped by the square root of their number): surfaces first, bins and basins rarely, so
# dishes end up in cabinets and food on counters or in the fridge rather than in the garbage.
PLAUSIBILITY = {
    "CounterTop": 3.0,
    "DiningTable": 3.0,
    "Desk": 3.0,
    "Fridge": 3.0,
    "SideTable": 2.0,
    "CoffeeTable": 2.0,
    "Dresser": 2.0,
    "Bed": 2.0,
    "Sofa": 2.0,
    "StoveBurner": 2.0,
    "CoffeeMachine": 2.0,
    "ToiletPaperHanger": 3.0,
    "TowelHolder": 3.0,
    "HandTowelHolder": 3.0,
    "LaundryHamper": 2.0,
    "ArmChair": 1.5,
    "Shelf": 1.5,
    "Cabinet": 1.5,
    "Drawer": 1.5,
    "Toilet": 1.0,
    "Cart": 1.0,
    "TVStand": 1.0,
    "Ottoman": 1.0,
    "BathtubBasin": 1.0,
    "Microwave": 0.7,
    "SinkBasin": 0.7,
    "Safe": 0.7,
    "GarbageCan": 0.4,
}
LAMP_PLAUSIBILITY = {"Desk": 3.0, "SideTable": 3.0, "Dresser": 2.0, "Shelf": 0.5}
# The appliance a state-change task needs, which is never also its goal receptacle.
DEVICE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
ABILITY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
TARGET_COUNTS = (1, 2, 3, 4)  # ALFRED's PICKUP_REPEAT_MAX is 4
DISTRACTOR_COUNTS = (1, 1, 1, 2, 2, 3)  # its MAX_NUM_OF_OBJ_INSTANCES is 3


class NoTask(Exception):
    """This room cannot host this task type with this draw; the caller draws again."""


@dataclass(frozen=True)
class Placed:
    """One object instance: ALFRED id, type, and the receptacle it starts in."""

    oid: str
    otype: str
    receptacle: Receptacle


@dataclass(frozen=True)
class Task:
    """A sampled game: the room, the objects, the agent's start, the goal and its sentence."""

    task_type: str
    scene: Scene
    target: str  # object type
    parent: str  # goal receptacle type ("" for look_at_obj_in_light)
    toggle: str  # "DeskLamp" for look_at_obj_in_light, else ""
    objects: tuple[Placed, ...]
    agent_loc: tuple[int, int, int, int]
    sentence: str  # "put a clean mug in coffeemachine."

    @property
    def folder_name(self) -> str:
        recep = self.toggle if self.task_type == "look_at_obj_in_light" else self.parent
        return f"{self.task_type}-{self.target}-None-{recep}-{self.scene.number}"

    def pddl_params(self) -> dict[str, object]:
        return {
            "mrecep_target": "",
            "object_sliced": False,
            "object_target": self.target,
            "parent_target": self.parent,
            "toggle_target": self.toggle,
        }


def rooms_for(task_type: str) -> frozenset[str]:
    return frozenset(constants().GOALS_VALID[task_type])


def scene_fits(scene: Scene, task_type: str) -> bool:
    """Whether the room has what the task type needs at all (cheap pre-filter)."""
    if scene.room not in rooms_for(task_type):
        return False
    kinds = scene.receptacle_types()
    if task_type in DEVICE and DEVICE[task_type] not in kinds:
        return False
    if task_type == "look_at_obj_in_light":
        return LAMP in scene.object_types and any(h in kinds for h in LAMP_HOLDERS)
    return True


def sample_task(scene: Scene, task_type: str, rng: random.Random) -> Task:
    """Draw one task of ``task_type`` in ``scene``; raises :class:`NoTask` if this draw fails."""
    c = constants()
    holds = c.VAL_RECEPTACLE_OBJECTS
    kinds = sorted(scene.receptacle_types())
    movable = set(c.MOVABLE_RECEPTACLES)

    def homes(otype: str, exclude: frozenset[str] = frozenset()) -> list[Receptacle]:
        return [
            r
            for r in scene.receptacles
            if r.rtype not in exclude and otype in holds.get(r.rtype, ())
        ]

    present = sorted(t for t in scene.object_types if t != LAMP and homes(t))
    candidates = present
    if task_type in ABILITY:
        able = c.VAL_ACTION_OBJECTS[ABILITY[task_type]]
        candidates = [t for t in candidates if t in able]
    if not candidates:
        raise NoTask("no object type fits")
    target = rng.choice(candidates)

    toggle = ""
    parent = ""
    if task_type == "look_at_obj_in_light":
        toggle = LAMP
        banned: frozenset[str] = frozenset()
    else:
        parents = [k for k in kinds if target in holds.get(k, ()) and k not in movable]
        parents = [k for k in parents if k != DEVICE.get(task_type)]
        if not parents:
            raise NoTask("no goal receptacle fits")
        parent = rng.choice(parents)
        banned = frozenset({parent})
    if task_type == "pick_cool_then_place_in_recep":
        banned = banned | {"Fridge"}  # a target already in the fridge would read as cold but is not
    starts = homes(target, banned)
    if not starts:
        raise NoTask("nowhere to put the target at the start")

    counts = TARGET_COUNTS[1:] if task_type == "pick_two_obj_and_place" else TARGET_COUNTS
    n_target = rng.choice(counts)
    taken: set[str] = {r.rid for r in scene.receptacles}
    objects: list[Placed] = []
    for _ in range(n_target):
        objects.append(_place(target, _pick(starts, PLAUSIBILITY, rng), rng, taken))

    holders = [r for r in scene.receptacles if r.rtype in LAMP_HOLDERS]
    if LAMP in scene.object_types and holders:  # the room's desk lamp, whatever the task
        objects.append(_place(LAMP, _pick(holders, LAMP_PLAUSIBILITY, rng), rng, taken))

    for otype in present:
        if otype == target:
            continue
        where = homes(otype)
        for _ in range(rng.choice(DISTRACTOR_COUNTS)):
            objects.append(_place(otype, _pick(where, PLAUSIBILITY, rng), rng, taken))

    agent_loc = _start(scene, rng)
    sentence = _sentence(task_type, target, parent, toggle, rng)
    objects.sort(key=lambda p: p.oid)
    return Task(task_type, scene, target, parent, toggle, tuple(objects), agent_loc, sentence)


def _pick(options: list[Receptacle], weights: dict[str, float], rng: random.Random) -> Receptacle:
    counts: dict[str, int] = {}
    for r in options:
        counts[r.rtype] = counts.get(r.rtype, 0) + 1
    w = [weights.get(r.rtype, 1.0) / counts[r.rtype] ** 0.5 for r in options]
    return rng.choices(options, weights=w, k=1)[0]


def _place(otype: str, receptacle: Receptacle, rng: random.Random, taken: set[str]) -> Placed:
    x, y, z = receptacle.position
    while True:
        oid = make_id(
            otype,
            x + rng.uniform(-0.35, 0.35),
            y + rng.uniform(0.02, 0.25),
            z + rng.uniform(-0.35, 0.35),
        )
        if oid not in taken:
            taken.add(oid)
            return Placed(oid, otype, receptacle)


def _start(scene: Scene, rng: random.Random) -> tuple[int, int, int, int]:
    used = {r.loc for r in scene.receptacles}
    for _ in range(100):
        x, z = rng.choice(scene.floor)
        loc = pose_to_loc(x, z, rng.choice((0, 90, 180, 270)), 30)
        if loc not in used:
            return loc
    raise NoTask("no free floor point to start on")


def _sentence(task_type: str, target: str, parent: str, toggle: str, rng: random.Random) -> str:
    from alfworld.gen import goal_library

    template = rng.choice(goal_library.gdict[task_type]["templates"])
    text = template.format(obj=target.lower(), recep=parent.lower(), toggle=toggle.lower())
    return f"{text}."


def goal_pddl(task: Task) -> str:
    """The goal block exactly as ALFWorld's games carry it (goal library, ``#`` as ``-``)."""
    from alfworld.gen import goal_library

    template = goal_library.gdict[task.task_type]["pddl"]
    return template.format(obj=task.target, recep=task.parent, toggle=task.toggle).replace("#", "-")
