"""Sample one ALFWorld task in one ALFRED room, drawn from ALFWorld's train split.

Every choice follows the train split's statistics (``train_stats.json``):

- the room type of a task type from the train split's rooms per task type, then one of that
  type's rooms (:func:`pick_scene`);
- (task type, object, receptacle) among the train split's combinations the room can host,
  weighted by their counts: no generated task is one ALFWorld's train split lacks;
- the target's number of copies from the train split's distribution for the task type;
- where each object starts from the train split's placement counts (receptacle type in
  proportion to its count among the room's types, then one instance of it); whether the target
  starts behind a closed door, and in a receptacle of the goal's type, with the train split's
  per-type shares. A state-change task's target never starts in its appliance (a clean task's
  in the sink, a heat task's in the microwave, a cool task's in the fridge), as in the train
  games; what is in a coffee machine is on the surface below it too, and an object on a burner
  rests on a second burner or counter as often as the train games show.

The room, the copies and the two shares are read off :class:`Controls`: for game ``i`` of a type,
a low-discrepancy (Kronecker) point, so that any run of games already follows the train
distributions closely (30 games per type, not thousands), while game ``i`` stays independent of
how many games are made. Task sentences are ALFWorld's templates (``alfworld.gen.goal_library``)
with a final full stop, as in its games.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envs.alfgen.scenes import (
    Loc,
    Placed,
    Receptacle,
    Scene,
    constants,
    place_on,
    placement_counts,
    pose_to_loc,
)
from envs.alfgen.stats import ROOM_TYPES, room_type, train_combo_counts, train_stats
from envs.discovery import TASK_TYPES

LAMP = "DeskLamp"
# The appliance a state-change task needs: never its goal receptacle, never where its target starts.
DEVICE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
# The train split counts about two instances of each object type in receptacles per room.
DISTRACTOR_COUNTS = (1, 1, 2, 2, 3, 3)
# Share of objects on a burner that rest on a second receptacle too (train games: 19 of 48).
ON_TWO = 0.4
REDRAW_SCENE_AFTER = 1  # attempts that keep the stratified room; later ones redraw all
REDRAW_ALL_AFTER = 10
# One irrational step per control (room, scene, copies, closed, goal): the fractional parts of
# square roots, whose continued fractions have small terms, so that any 30 consecutive games
# miss a share by under two games.
_STEPS = tuple(math.sqrt(p) % 1.0 for p in (5, 7, 2, 3, 13))


class NoTask(Exception):
    """This room cannot host this task type with this draw; the caller draws again."""


@dataclass(frozen=True)
class Controls:
    """Points in [0, 1) that pick the room type, the room, the copies and the two shares."""

    room: float
    scene: float
    copies: float
    closed: float
    goal: float
    strict: bool = True  # a room that cannot meet the shares fails the draw (else: relaxed)

    def redrawn(self, rng: random.Random, attempt: int) -> Controls:
        """The controls of a later attempt: another room of the same type first, then everything
        drawn afresh (and the shares relaxed where a room cannot meet them)."""
        if attempt < REDRAW_SCENE_AFTER:
            return self
        if attempt < REDRAW_ALL_AFTER:
            return Controls(self.room, rng.random(), self.copies, self.closed, self.goal)
        room, scene, copies, closed, goal = (rng.random() for _ in range(5))
        return Controls(room, scene, copies, closed, goal, strict=False)


def controls_for(seed: int, task_type: str, index: int) -> Controls:
    """Game ``index``'s point of the (seed, task type) Kronecker sequence."""
    digest = hashlib.sha256(f"alfgen-controls:{seed}:{task_type}".encode()).digest()
    starts = [int.from_bytes(digest[4 * k : 4 * k + 4], "big") / 2**32 for k in range(5)]
    room, scene, copies, closed, goal = (
        (start + (index + 1) * step) % 1.0 for start, step in zip(starts, _STEPS, strict=True)
    )
    return Controls(room, scene, copies, closed, goal)


@dataclass(frozen=True)
class Task:
    """A sampled game: the room, the objects, the agent's start, the goal and its sentence."""

    task_type: str
    scene: Scene
    target: str  # object type
    parent: str  # goal receptacle type ("" for look_at_obj_in_light)
    toggle: str  # "DeskLamp" for look_at_obj_in_light, else ""
    objects: tuple[Placed, ...]
    agent_loc: Loc
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


@functools.cache
def combos(task_type: str) -> tuple[tuple[str, str, int], ...]:
    """The train split's ``(object, receptacle, games)`` of a task type (receptacle ``DeskLamp``
    for look_at_obj_in_light)."""
    short = TASK_TYPES[task_type]
    return tuple(
        (obj, recep, n)
        for (t, obj, mrecep, recep), n in sorted(train_combo_counts().items())
        if t == short and mrecep == "None"
    )


def train_figure(name: str, task_type: str) -> Mapping[str, float]:
    """One per-task-type table of ``train_stats.json`` (e.g. ``room_by_task_type``)."""
    table = train_stats()[name]
    assert isinstance(table, dict)
    value = table.get(TASK_TYPES[task_type], {})
    return {str(k): float(v) for k, v in value.items()}


def train_share(name: str, task_type: str) -> float:
    table = train_stats()[name]
    assert isinstance(table, dict)
    return float(table.get(TASK_TYPES[task_type], 0.0))


def inverse_cdf(weights: Sequence[tuple[str, float]], u: float) -> str:
    """The value whose cumulative-weight interval holds ``u`` (weights in the given order)."""
    total = sum(w for _, w in weights)
    acc = 0.0
    for value, w in weights:
        acc += w / total
        if u < acc:
            return value
    return weights[-1][0]


def pick_scene(pool: Sequence[Scene], task_type: str, controls: Controls) -> Scene:
    """A room of ``pool``: its type by the train split's shares for ``task_type`` (among the types
    ``pool`` has; evenly if it has none of them), then one of that type's rooms."""
    rooms: dict[str, list[Scene]] = {}
    # Ordered by size, so that evenly spread controls spread the games over small and large rooms.
    for scene in sorted(pool, key=lambda s: (len(s.receptacles), s.number)):
        rooms.setdefault(room_type(scene.number), []).append(scene)
    shares = train_figure("room_by_task_type", task_type)
    weights = [(r, shares.get(r, 0.0)) for r in ROOM_TYPES if r in rooms and shares.get(r)]
    if not weights:
        weights = [(r, 1.0) for r in ROOM_TYPES if r in rooms]
    scenes = rooms[inverse_cdf(weights, controls.room)]
    return scenes[min(int(controls.scene * len(scenes)), len(scenes) - 1)]


def scene_fits(scene: Scene, task_type: str) -> bool:
    """Whether the room can host one of the train split's combinations of this task type."""
    return any(_fits(scene, task_type, obj, recep) for obj, recep, _ in combos(task_type))


def sample_task(scene: Scene, task_type: str, rng: random.Random, controls: Controls) -> Task:
    """Draw one task of ``task_type`` in ``scene``; raises :class:`NoTask` if this draw fails."""
    copies = int(inverse_cdf(_copies(task_type), controls.copies))
    closed = controls.closed < train_share("share_target_behind_closed_door", task_type)
    in_goal = controls.goal < train_share("share_target_starts_in_goal_receptacle_type", task_type)
    # The train shares win over the combination's weight. A room that cannot meet them for any
    # combination fails a strict draw (the next attempt tries another room of the type); late
    # attempts give up the closed door first, then the goal-type start.
    tries = ((in_goal, closed), (in_goal, not closed), (not in_goal, closed), (False, False))
    for want in tries[: None if not controls.strict else 1]:
        options = [
            (obj, recep, n)
            for obj, recep, n in combos(task_type)
            if _fits(scene, task_type, obj, recep)
            and _homes(scene, task_type, obj, recep, copies, *want) is not None
        ]
        if options:
            break
    else:
        raise NoTask("no train combination fits this room")
    target, recep, _ = rng.choices(options, weights=[n for *_, n in options], k=1)[0]
    homes = _homes(scene, task_type, target, recep, copies, *want)
    assert homes is not None
    is_lamp = task_type == "look_at_obj_in_light"
    parent, toggle = ("", LAMP) if is_lamp else (recep, "")

    taken = {r.rid for r in scene.receptacles} | {p.oid for p in scene.fixed}
    objects = list(scene.fixed)
    for required, allowed in homes:
        home = _weighted(required or allowed, rng)
        objects.append(_put(scene, target, home, rng, taken, avoid=parent if not want[0] else ""))
    for otype in sorted(scene.object_types - {target}):
        where = _starts(scene, otype, frozenset())
        for _ in range(rng.choice(DISTRACTOR_COUNTS) if where else 0):
            objects.append(_put(scene, otype, _weighted(where, rng), rng, taken))

    agent_loc = _start(scene, rng)
    sentence = _sentence(task_type, target, parent, toggle, rng)
    objects.sort(key=lambda p: p.oid)
    return Task(task_type, scene, target, parent, toggle, tuple(objects), agent_loc, sentence)


Weighted = list[tuple[Receptacle, float]]


def _copies(task_type: str) -> list[tuple[str, float]]:
    table = train_figure("target_copies_by_task_type", task_type)
    return sorted(table.items(), key=lambda kv: int(kv[0]))


def _fits(scene: Scene, task_type: str, obj: str, recep: str) -> bool:
    if obj not in scene.object_types:
        return False
    if task_type == "look_at_obj_in_light":
        if scene.fixture(LAMP) is None:
            return False
    elif recep not in scene.receptacle_types() or recep == DEVICE.get(task_type):
        return False
    device = DEVICE.get(task_type)
    return device is None or device in scene.receptacle_types()


def _starts(scene: Scene, otype: str, banned: frozenset[str]) -> Weighted:
    """Receptacles ``otype`` may start in, weighted so each type's share follows its train count
    (``VAL_RECEPTACLE_OBJECTS``, evenly, for a type the train split never placed in this room's
    receptacles)."""
    kinds = Counter(r.rtype for r in scene.receptacles)
    counts = placement_counts().get(otype, {})
    out = [
        (r, counts[r.rtype] / kinds[r.rtype])
        for r in scene.receptacles
        if counts.get(r.rtype, 0) > 0 and r.rtype not in banned
    ]
    if out:
        return out
    holds = constants().VAL_RECEPTACLE_OBJECTS
    return [
        (r, 1.0 / kinds[r.rtype])
        for r in scene.receptacles
        if otype in holds.get(r.rtype, ()) and r.rtype not in banned
    ]


def _homes(
    scene: Scene, task_type: str, target: str, recep: str, copies: int, in_goal: bool, closed: bool
) -> list[tuple[Weighted, Weighted]] | None:
    """Per copy of the target: (receptacles it must come from, or none; receptacles it may come
    from), so that the copies start behind a closed door and in a goal-type receptacle exactly
    as asked. ``None`` when the room cannot do that."""
    device = DEVICE.get(task_type)
    cands = _starts(scene, target, frozenset({device}) if device else frozenset())

    def goal_type(r: Receptacle) -> bool:
        return any(x.rtype == recep for x in _footprint(scene, r))

    allowed = [
        (r, w) for r, w in cands if (in_goal or not goal_type(r)) and (closed or not r.openable)
    ]
    needs: list[Weighted] = []
    if in_goal and closed and copies == 1:
        needs.append([(r, w) for r, w in allowed if goal_type(r) and r.openable])
    else:
        if in_goal:
            needs.append([(r, w) for r, w in allowed if goal_type(r)])
        if closed:
            needs.append([(r, w) for r, w in allowed if r.openable])
    if not allowed or any(not n for n in needs):
        return None
    return [(n, allowed) for n in needs] + [([], allowed)] * (copies - len(needs))


def _footprint(scene: Scene, r: Receptacle) -> tuple[Receptacle, ...]:
    """The receptacles an object put in ``r`` is in (a coffee machine's surface too)."""
    below = scene.stands_on.get(r.rid)
    return (r, *(s for s in scene.receptacles if s.rid == below))


def _put(
    scene: Scene,
    otype: str,
    home: Receptacle,
    rng: random.Random,
    taken: set[str],
    avoid: str = "",
) -> Placed:
    also = list(_footprint(scene, home)[1:])
    if home.rtype == "StoveBurner" and rng.random() < ON_TWO:
        second = _neighbour(scene, home, "StoveBurner" if rng.random() < 0.6 else "CounterTop")
        if second is not None and second.rtype != avoid:
            also.append(second)
    return place_on(otype, home, rng, taken, tuple(also))


def _neighbour(scene: Scene, r: Receptacle, rtype: str) -> Receptacle | None:
    x, _, z = r.position
    others = [o for o in scene.of_type(rtype) if o.rid != r.rid]
    if not others:
        return None
    return min(others, key=lambda o: ((o.position[0] - x) ** 2 + (o.position[2] - z) ** 2, o.rid))


def _weighted(options: Weighted, rng: random.Random) -> Receptacle:
    return rng.choices([r for r, _ in options], weights=[w for _, w in options], k=1)[0]


def _start(scene: Scene, rng: random.Random) -> Loc:
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
