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
  in the sink, a heat task's in the microwave, a cool task's in the fridge): the train split
  has no walkthrough that takes it from there; what is in a coffee machine is on the surface
  below it too, and an object on a burner rests on a second burner or counter as often as the
  train games show;
- the walkthrough length from the train split's lengths (:func:`lengths_for`): the draw is
  narrowed to combinations and placements that can give it, and :func:`shortest_plan` checks it
  before the planner runs.

The room, the copies and the two shares are read off :class:`Controls`: for game ``i`` of a type,
a low-discrepancy (Kronecker) point, and its length is herded (:func:`lengths_for`), so that any
run of games already follows the train distributions closely (30 games per type, not
thousands), while game ``i`` stays independent of how many games are made. Task sentences are ALFWorld's templates (``alfworld.gen.goal_library``)
with a final full stop, as in its games.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
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
# Share of objects on a burner that rest on a second receptacle too (train games: 19 of 48), a
# burner 6 times in 10, else a counter.
ON_TWO = 0.4
BURNER_SECONDS = ("StoveBurner", "CounterTop")
# Attempts at one game: the first ones keep the stratified room (other combinations and
# placements), then other rooms of the same type, then any walkthrough length will do, then
# everything is drawn afresh and relaxed.
REDRAW_SCENE_AFTER = 10
ANY_LENGTH_AFTER = 20
REDRAW_ALL_AFTER = 30
# Walkthrough length with no door to open on the way (the walkthrough of a target behind a door
# that is its only copy, or one of its two for puttwo, is longer).
NO_DOOR_LENGTH = {
    "pick_and_place_simple": 4,
    "pick_clean_then_place_in_recep": 6,
    "pick_heat_then_place_in_recep": 6,
    "pick_cool_then_place_in_recep": 6,
    "look_at_obj_in_light": 3,
    "pick_two_obj_and_place": 8,
}
# One irrational step per control (room, scene, copies, closed, goal): the fractional parts of
# square roots, whose continued fractions have small terms, so that any 30 consecutive games
# miss a share by under two games.
_STEPS = tuple(math.sqrt(p) % 1.0 for p in (5, 7, 2, 3, 13))


class NoTask(Exception):
    """This room cannot host this task type with this draw; the caller draws again."""


@dataclass(frozen=True)
class Controls:
    """Points in [0, 1) that pick the room type, the room, the copies and the two shares, and the
    walkthrough length the game must have (0: any)."""

    room: float
    scene: float
    copies: float
    closed: float
    goal: float
    length: int
    strict: bool = True  # a room that cannot meet the shares fails the draw (else: relaxed)

    def redrawn(self, rng: random.Random, attempt: int) -> Controls:
        """The controls of a later attempt: the same first, then another room of the same type,
        then any walkthrough length, then everything drawn afresh (and the shares relaxed where a
        room cannot meet them)."""
        if attempt < REDRAW_SCENE_AFTER:
            return self
        if attempt < ANY_LENGTH_AFTER:
            return dataclasses.replace(self, scene=rng.random())
        if attempt < REDRAW_ALL_AFTER:
            return dataclasses.replace(self, scene=rng.random(), length=0)
        room, scene, copies, closed, goal = (rng.random() for _ in range(5))
        return Controls(room, scene, copies, closed, goal, 0, strict=False)

    def wanted(self, task_type: str) -> Wanted:
        """The copies and shares these controls pick from the train split's distributions."""
        copies = int(inverse_cdf(_copies(task_type), self.copies))
        closed = self.closed < train_share("share_target_behind_closed_door", task_type)
        p_goal = train_share("share_target_starts_in_goal_receptacle_type", task_type)
        return Wanted(copies, closed, self.goal < p_goal)


@dataclass(frozen=True)
class Wanted:
    """Target copies and whether one starts behind a closed door / in a goal-type receptacle."""

    copies: int
    closed: bool
    in_goal: bool


def controls_for(seed: int, task_type: str, index: int) -> Controls:
    """Game ``index``'s point of the (seed, task type) Kronecker sequence and its walkthrough
    length (see :func:`lengths_for`)."""
    return _point(seed, task_type, index, lengths_for(seed, task_type, index + 1)[index])


def _point(seed: int, task_type: str, index: int, length: int) -> Controls:
    digest = hashlib.sha256(f"alfgen-controls:{seed}:{task_type}".encode()).digest()
    starts = [int.from_bytes(digest[4 * k : 4 * k + 4], "big") / 2**32 for k in range(5)]
    room, scene, copies, closed, goal = (
        (start + (index + 1) * step) % 1.0 for start, step in zip(starts, _STEPS, strict=True)
    )
    return Controls(room, scene, copies, closed, goal, length)


_LENGTHS: dict[tuple[int, str], list[int]] = {}


def lengths_for(seed: int, task_type: str, count: int) -> list[int]:
    """The walkthrough lengths of games ``0..count-1``: each game takes, among the lengths its
    copies and shares allow (:func:`length_fits`), the one furthest behind the train split's
    share so far (herding), so that any run of games follows the train split's walkthrough
    lengths to within about a game each. Game ``i``'s length depends on games ``0..i`` only."""
    made = _LENGTHS.setdefault((seed, task_type), [])
    table = train_figure("walkthrough_length_by_task_type", task_type)
    share = {int(k): v / sum(table.values()) for k, v in table.items()}
    counts = Counter(made)
    while len(made) < count:
        want = _point(seed, task_type, len(made), 0).wanted(task_type)
        fits = [n for n in sorted(share) if length_fits(task_type, n, want)]
        best = max(fits, key=lambda n: (len(made) + 1) * share[n] - counts[n]) if fits else 0
        counts[best] += 1
        made.append(best)
    return made[:count]


def length_fits(task_type: str, length: int, want: Wanted) -> bool:
    """Whether a game with these copies and shares can have a walkthrough of ``length``: a lone
    copy behind a door (two, for puttwo) takes a step to open it, a target already in a doorless
    goal-type receptacle goes back there without one, only a copy in a second goal-type
    receptacle (a mug in a coffee machine on the goal counter) saves the trip back."""
    base = NO_DOOR_LENGTH[task_type]
    if length <= base:
        shortcut = task_type in DEVICE and length < base
        return not _hidden(task_type, want) and (want.in_goal or not shortcut)
    if length == base + 1:
        return not (task_type in DEVICE and want.in_goal and not want.closed)
    return want.closed and not want.in_goal  # two doors: the target's and the goal's


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
    """Draw one task of ``task_type`` in ``scene``; raises :class:`NoTask` if this draw fails.

    Combinations and placements are narrowed to those that can give the walkthrough length the
    controls ask for (a goal receptacle behind a door, a copy at the desk lamp...); the caller
    checks the length (:func:`shortest_plan`) and draws again when it is not met.
    """
    want = controls.wanted(task_type)
    # The train shares win over the combination's weight. A room that cannot meet them for any
    # combination fails a strict draw (the next attempt tries another room of the type); late
    # attempts give up the closed door first, then the goal-type start.
    tries = [want]
    if not controls.strict:
        tries += [
            Wanted(want.copies, not want.closed, want.in_goal),
            Wanted(want.copies, want.closed, not want.in_goal),
            Wanted(want.copies, False, False),
        ]
    for shape in tries:
        options = [
            (obj, recep, n)
            for obj, recep, n in combos(task_type)
            if _fits(scene, task_type, obj, recep, shape, controls.length)
            and _homes(scene, task_type, obj, recep, shape, controls.length) is not None
        ]
        if options:
            break
    else:
        raise NoTask("no train combination fits this room")
    target, recep, _ = rng.choices(options, weights=[n for *_, n in options], k=1)[0]
    homes = _homes(scene, task_type, target, recep, shape, controls.length)
    assert homes is not None
    is_lamp = task_type == "look_at_obj_in_light"
    parent, toggle = ("", LAMP) if is_lamp else (recep, "")

    taken = {r.rid for r in scene.receptacles} | {p.oid for p in scene.fixed}
    objects = list(scene.fixed)
    for required, allowed, second in homes:
        home = _weighted(required or allowed, rng)
        objects.append(_put(scene, target, home, rng, taken, avoid=parent, second=second))
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


def _fits(
    scene: Scene, task_type: str, obj: str, recep: str, want: Wanted | None = None, length: int = 0
) -> bool:
    """Whether the room has the object, the goal receptacle and the appliance; with ``want`` and
    ``length``, also whether reaching the goal receptacle takes the door the length asks for."""
    if obj not in scene.object_types:
        return False
    if task_type == "look_at_obj_in_light":
        return scene.fixture(LAMP) is not None
    kinds = scene.receptacle_types()
    device = DEVICE.get(task_type)
    if recep not in kinds or recep == device or (device is not None and device not in kinds):
        return False
    if want is None or not length:
        return True
    extra = length - NO_DOOR_LENGTH[task_type]
    if not want.closed:
        door = extra >= 1  # no door on the way to the target: any extra step is the goal's door
    elif _hidden(task_type, want) and not want.in_goal and task_type != "pick_two_obj_and_place":
        door = extra >= 2  # one door is the target's
    else:
        return True
    return door == all(r.openable for r in scene.of_type(recep))


def _hidden(task_type: str, want: Wanted) -> bool:
    """Whether every copy the task takes is behind a door."""
    return want.closed and want.copies <= (2 if task_type == "pick_two_obj_and_place" else 1)


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
    scene: Scene, task_type: str, target: str, recep: str, want: Wanted, length: int = 0
) -> list[tuple[Weighted, Weighted, str]] | None:
    """Per copy of the target: (receptacles it must come from, or none; receptacles it may come
    from; the type of a second receptacle it must also be in, or ""), so that the copies start
    behind a closed door and in a goal-type receptacle exactly as ``want`` asks, and can give a
    walkthrough of ``length`` (0: any). ``None`` when the room cannot do that."""
    device = DEVICE.get(task_type)
    cands = _starts(scene, target, frozenset({device}) if device else frozenset())
    base = NO_DOOR_LENGTH[task_type]
    # A copy that is also in a goal-type receptacle below (a coffee machine on the goal counter,
    # a pan over a second burner) needs no trip back: the length asks for it, or it is avoided.
    shortcut = device is not None and 0 < length < base

    def below(r: Receptacle) -> str:
        if any(x.rtype == recep for x in _footprint(scene, r)[1:]):
            return recep
        over = recep in BURNER_SECONDS and _neighbour(scene, r, recep) is not None
        if shortcut and r.rtype == "StoveBurner" and over:
            return recep
        return ""

    allowed = [
        (r, w)
        for r, w in cands
        if (want.closed or not r.openable)
        and (want.in_goal or r.rtype != recep)
        and (
            shortcut and want.in_goal or not any(x.rtype == recep for x in _footprint(scene, r)[1:])
        )
    ]
    needs: list[tuple[Weighted, str]] = []
    closed_need = [(r, w) for r, w in allowed if r.openable]
    if shortcut:
        needs.append(([(r, w) for r, w in allowed if below(r) and not r.openable], recep))
    elif want.in_goal:
        goal = [(r, w) for r, w in allowed if r.rtype == recep]
        if want.closed and want.copies == 1:
            goal, closed_need = [(r, w) for r, w in goal if r.openable], goal
        needs.append((goal, ""))
    if task_type == "look_at_obj_in_light" and length:
        lamp = scene.fixture(LAMP)
        assert lamp is not None
        near = [(r, w) for r, w in allowed if r.loc == lamp.loc]
        if length == base:  # a copy where the lamp is, on an open surface
            needs.append(([(r, w) for r, w in near if not r.openable], ""))
        elif _hidden(task_type, want):  # the lone copy behind a door where the lamp is
            closed_need = [(r, w) for r, w in near if r.openable]
        else:  # nothing to take where the lamp is without opening a door
            allowed = [(r, w) for r, w in allowed if r.loc != lamp.loc or r.openable]
            closed_need = [(r, w) for r, w in allowed if r.openable]
    if want.closed and not (want.in_goal and want.copies == 1 and not shortcut):
        needs.append((closed_need, ""))
    if not allowed or len(needs) > want.copies or any(not n for n, _ in needs):
        return None
    return [(n, allowed, second) for n, second in needs] + [([], allowed, "")] * (
        want.copies - len(needs)
    )


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
    second: str = "",
) -> Placed:
    """An instance of ``otype`` in ``home`` (and what ``home`` stands on); on a burner, as often
    as in the train games, also over a second burner or counter (of type ``second`` if given,
    never of type ``avoid``)."""
    also = list(_footprint(scene, home)[1:])
    if home.rtype == "StoveBurner" and (second or rng.random() < ON_TWO):
        kind = second or BURNER_SECONDS[rng.random() >= 0.6]
        extra = _neighbour(scene, home, kind)
        if extra is not None and (second or extra.rtype != avoid) and extra not in also:
            also.append(extra)
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


def shortest_plan(task: Task) -> int:
    """Actions in a shortest winning plan (the planner's walkthrough), from where the target's
    copies start, the doors, and which receptacles share a location. Going somewhere, opening,
    taking, putting, and the one clean/heat/cool/use action count one each; what is taken from
    one receptacle stays in any other it is in (a mug in a coffee machine on the goal counter)."""
    scene = task.scene
    copies = [p for p in task.objects if p.otype == task.target and p.receptacles]
    if task.task_type == "look_at_obj_in_light":
        lamp = scene.fixture(LAMP)
        assert lamp is not None
        return min(f + (at != lamp.loc) + 1 for c in copies for f, at, _, _ in _fetch(c, None, ()))
    parents = scene.of_type(task.parent)
    best = 10**6
    if task.task_type == "pick_two_obj_and_place":
        for c1 in copies:
            for c2 in copies:
                if c1 is c2:
                    continue
                for f1, at1, open1, _ in _fetch(c1, None, ()):
                    for p in parents:
                        d1 = _deliver(at1, open1, p)
                        done = open1 | ({p.rid} if p.openable else set())
                        for f2, at2, open2, _ in _fetch(c2, p.loc, done):
                            best = min(best, f1 + d1 + f2 + _deliver(at2, open2, p))
        return best
    device = DEVICE.get(task.task_type)
    for c in copies:
        for f, at, opened, rest in _fetch(c, None, ()):
            if device is None:
                best = min(best, f + min(_deliver(at, opened, p) for p in parents))
                continue
            for d in scene.of_type(device):
                cost = f + (at != d.loc) + 1
                if all(r.rtype != task.parent for r in rest):
                    cost += min(_deliver(d.loc, opened, p) for p in parents)
                best = min(best, cost)
    return best


def _fetch(
    copy: Placed, at: Loc | None, opened: Collection[str]
) -> list[tuple[int, Loc, set[str], tuple[Receptacle, ...]]]:
    """Each way to take ``copy``: (actions, where the agent ends, receptacles open, the
    receptacles ``copy`` is still in)."""
    out = []
    for r in copy.receptacles:
        door = r.openable and r.rid not in opened
        rest = tuple(x for x in copy.receptacles if x.rid != r.rid)
        out.append(((at != r.loc) + door + 1, r.loc, {*opened, *([r.rid] if door else [])}, rest))
    return out


def _deliver(at: Loc, opened: Collection[str], p: Receptacle) -> int:
    return (at != p.loc) + (p.openable and p.rid not in opened) + 1


def _sentence(task_type: str, target: str, parent: str, toggle: str, rng: random.Random) -> str:
    from alfworld.gen import goal_library  # heavy: alfworld, only to play or make a game

    template = rng.choice(goal_library.gdict[task_type]["templates"])
    text = template.format(obj=target.lower(), recep=parent.lower(), toggle=toggle.lower())
    return f"{text}."


def goal_pddl(task: Task) -> str:
    """The goal block exactly as ALFWorld's games carry it (goal library, ``#`` as ``-``)."""
    from alfworld.gen import goal_library  # heavy: alfworld, only to play or make a game

    template = goal_library.gdict[task.task_type]["pddl"]
    return template.format(obj=task.target, recep=task.parent, toggle=task.toggle).replace("#", "-")
