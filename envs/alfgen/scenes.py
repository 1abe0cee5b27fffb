"""ALFRED floor plans as the alfworld package ships them, turned into text-game rooms.

A room's receptacle types and object types come from ``FloorPlan<N>-objects.json``; receptacle
instances (real AI2-THOR ids) and the pose the agent takes to use them from
``FloorPlan<N>-openable.json``; reachable floor points from ``FloorPlan<N>-layout.npy``.

Those layouts list only the receptacles that have doors (and the surfaces): a room of ALFWorld's
train split gets the rest from the train split's own receptacle list (``train_stats.json``):
the missing cabinets and drawers (doorless: the train games show every layout-missing cabinet
and drawer as not openable), shelves, burners, holders and so on, stacked at a listed instance of
their type, or at a made-up spot when the layout lists none. Receptacles a room has but neither
source places get deterministic made-up instances, so a room always has the same furniture
whatever game is generated in it.

Rooms without train games keep what the layouts give (no offline source lists their doorless
receptacles). ALFRED's four unseen rooms (ALFWorld's ``eval_out_of_distribution`` split) come out
as: kitchen 10 with 22 receptacles (3 cabinets, 3 drawers), living room 219 with 27, bedroom 308
with 14, bathroom 424 with 12. On the 108 train rooms the layouts (with made-up instances) miss
1.7 receptacles per room (kitchens 3.8, living rooms 0.2, bedrooms 1.5, bathrooms 1.1; of the
179 missing, 73 doorless cabinets, 66 doorless drawers, 15 shelves, 19 towel holders), so
expect the unseen rooms, kitchen 10 most, to be short by about that much.

Fixed objects (desk lamp, house plant, television) stand in one receptacle of the room, the same
in every game; floor objects (basketball, baseball bat, boots, plunger, scrub brush, tennis racket)
lie on the floor, in no receptacle, as in ALFWorld's games. A coffee machine stands on the counter
or table nearest to it: what is in it is on that surface too, as in ALFWorld's games.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.alfgen.stats import train_scene_receptacles, train_stats
from envs.errors import EnvError

GRID = 0.25  # AI2-THOR's navigation step, in metres; ALFWorld locations count in steps
Loc = tuple[int, int, int, int]  # x, z (grid steps), rotation (quarter turns), camera horizon

ROOMS: dict[str, range] = {
    "Kitchen": range(1, 31),
    "LivingRoom": range(201, 231),
    "Bedroom": range(301, 331),
    "Bathroom": range(401, 431),
}
# ALFRED's valid_unseen rooms, i.e. ALFWorld's eval_out_of_distribution split: games for the other
# splits never use them, so a generated train game never shows an agent an OOD-evaluation room.
UNSEEN_EVAL_SCENES: tuple[int, ...] = (10, 219, 308, 424)

# Objects the agent cannot pick up that ALFWorld's games show in a receptacle (the train split
# counts about one per room that has one); the other fixtures (mirrors, windows, sinks,
# bathtubs, curtains, shower glass, floor lamps) are in a receptacle in under a fifth of the
# train games' rooms, and are left out like ALFWorld's other wall and floor fixtures.
FIXTURES = ("DeskLamp", "HousePlant", "Television")
NOT_PICKUPABLE = frozenset(
    FIXTURES + ("Bathtub", "Curtains", "FloorLamp", "Mirror", "ShowerGlass", "Sink", "Window")
)
# Pickupable objects ALFWorld's games keep on the floor (never in a receptacle: out of reach).
FLOOR_OBJECTS = ("BaseballBat", "BasketBall", "Boots", "Plunger", "ScrubBrush", "TennisRacket")
# Extra instances of these stack at a listed instance of their type (drawers in a chest, shelves
# in a unit, burners on one stove), sharing its location; other types get a spot of their own.
STACKED = frozenset({"Cabinet", "Drawer", "Shelf", "StoveBurner", "HandTowelHolder", "TowelHolder"})
# Made-up receptacles have doors only where the type always has one: the train games show every
# cabinet and drawer the layouts leave out as doorless.
ALWAYS_DOORS = frozenset({"Fridge", "Microwave", "Safe"})
# What a coffee machine stands on.
SURFACES = ("CounterTop", "DiningTable")

# Receptacles the layouts often leave unplaced: how many instances a room gets, and how high they
# sit (only the look of the id depends on the height).
_SYNTH_COUNT = {"StoveBurner": 4}
_SYNTH_HEIGHT = {
    "CoffeeMachine": 0.90,
    "StoveBurner": 0.94,
    "Toaster": 0.90,
    "GarbageCan": 0.00,
    "Toilet": 0.00,
    "LaundryHamper": 0.00,
    "ToiletPaperHanger": 0.66,
    "TowelHolder": 1.10,
    "HandTowelHolder": 1.60,
    "Cabinet": 0.40,
    "Drawer": 0.75,
    "Shelf": 0.55,
    "SinkBasin": 0.82,
    "BathtubBasin": 0.30,
}
_STACK_STEP = 0.22  # metres between stacked instances' ids
_BASINS = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}


@dataclass(frozen=True)
class Receptacle:
    """A static receptacle: its ALFRED id (``Cabinet|+00.68|+00.50|-02.20``), type and location."""

    rid: str
    rtype: str
    loc: Loc
    openable: bool

    @property
    def position(self) -> tuple[float, float, float]:
        x, y, z = (float(v) for v in self.rid.split("|")[1:4])
        return x, y, z


@dataclass(frozen=True)
class Placed:
    """One object instance: ALFRED id, type, the receptacles it is in (none: on the floor, out of
    reach) and its location."""

    oid: str
    otype: str
    receptacles: tuple[Receptacle, ...]
    loc: Loc


@dataclass(frozen=True)
class Scene:
    """One ALFRED room: receptacles, the movable object types it holds, fixed and floor objects,
    free floor points, and what stands on what (``rid -> rid`` the coffee machine on a surface)."""

    number: int
    room: str
    receptacles: tuple[Receptacle, ...]
    object_types: frozenset[str]
    fixed: tuple[Placed, ...]
    floor: tuple[tuple[float, float], ...]
    stands_on: Mapping[str, str]
    complete: bool  # the receptacle list is the train split's

    @property
    def floor_plan(self) -> str:
        return f"FloorPlan{self.number}"

    def receptacle_types(self) -> frozenset[str]:
        return frozenset(r.rtype for r in self.receptacles)

    def of_type(self, rtype: str) -> list[Receptacle]:
        return [r for r in self.receptacles if r.rtype == rtype]

    def fixture(self, otype: str) -> Placed | None:
        return next((p for p in self.fixed if p.otype == otype and p.receptacles), None)


def room_of(number: int) -> str:
    for room, numbers in ROOMS.items():
        if number in numbers:
            return room
    raise EnvError(f"floor plan {number} is not an ALFRED room number")


def alfworld_dir() -> Path:
    """The installed alfworld package's folder, found without importing it."""
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise EnvError("the game generator needs alfworld: pip install 'alfworld>=0.4,<0.5'")
    return Path(next(iter(spec.submodule_search_locations)))


def constants() -> Any:
    """``alfworld.gen.constants`` (ALFRED's object and receptacle tables)."""
    # heavy: alfworld, only to play or make a game
    import alfworld.gen.constants as alfred_constants

    return alfred_constants


def fmt_coord(value: float) -> str:
    """AI2-THOR's id number format: ``+01.25``, ``-00.40``, and ``00.00`` for zero."""
    v = round(value, 2)
    if v == 0:
        return "00.00"
    return f"{v:+06.2f}"


def make_id(name: str, x: float, y: float, z: float, suffix: str = "") -> str:
    rid = f"{name}|{fmt_coord(x)}|{fmt_coord(y)}|{fmt_coord(z)}"
    return f"{rid}|{suffix}" if suffix else rid


def pose_to_loc(x: float, z: float, rotation: float, horizon: float) -> Loc:
    return (
        int(round(x / GRID)),
        int(round(z / GRID)),
        int(round(rotation / 90.0)) % 4,
        int(round(horizon)),
    )


def static_receptacle_types() -> frozenset[str]:
    c = constants()
    return frozenset(t for t in c.VAL_RECEPTACLE_OBJECTS if t not in c.MOVABLE_RECEPTACLES_SET)


@functools.cache
def placement_counts() -> dict[str, dict[str, int]]:
    """Train split: ``object type -> receptacle type -> instances that start there``."""
    counts = train_stats()["placement_counts"]
    assert isinstance(counts, dict)
    return {o: {r: int(n) for r, n in rs.items()} for o, rs in counts.items()}


def movable_types() -> frozenset[str]:
    """Object types the agent can pick up that the train split shows in receptacles."""
    return frozenset(placement_counts()) - NOT_PICKUPABLE


def available_scenes() -> list[int]:
    layouts = alfworld_dir() / "gen" / "layouts"
    numbers = []
    for path in layouts.glob("FloorPlan*-objects.json"):
        stem = path.name[len("FloorPlan") : -len("-objects.json")]
        if stem.isdigit():
            numbers.append(int(stem))
    if not numbers:
        raise EnvError(f"no ALFRED floor plans under {str(layouts)!r}: reinstall alfworld")
    return sorted(numbers)


def _stream(*parts: object) -> random.Random:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@functools.cache
def load_scene(number: int) -> Scene:
    """Read one floor plan (cached): the same room every time it is asked for."""
    layouts = alfworld_dir() / "gen" / "layouts"
    base = layouts / f"FloorPlan{number}"
    try:
        present = set(json.loads(Path(f"{base}-objects.json").read_text()))
        poses: dict[str, list[float]] = json.loads(Path(f"{base}-openable.json").read_text())
        floor_arr = np.load(f"{base}-layout.npy")
    except (OSError, ValueError) as exc:
        raise EnvError(
            f"floor plan {number} is unreadable ({exc.__class__.__name__}): reinstall alfworld"
        ) from None
    floor = tuple(sorted((float(x), float(z)) for x, z in floor_arr.tolist()))
    static = static_receptacle_types()
    doors = constants().OPENABLE_CLASS_SET

    receptacles: list[Receptacle] = []
    for rid in sorted(poses):
        parts = rid.split("|")
        rtype = parts[-1] if parts[-1] in _BASINS else parts[0]
        if rtype not in static:
            continue
        x, z, rotation, horizon = poses[rid]
        loc = pose_to_loc(x, z, rotation, horizon)
        receptacles.append(Receptacle(rid, rtype, loc, rtype in doors))

    rng = _stream("scene", number)
    taken = {r.rid for r in receptacles}
    placed = {r.rtype for r in receptacles}
    for rtype in sorted(static & present - placed):
        count = _SYNTH_COUNT.get(rtype, 1)
        receptacles.extend(_synthesize(rtype, count, floor, rng, taken))

    wanted = train_scene_receptacles().get(number)
    if wanted is not None:
        receptacles = _complete(receptacles, wanted, floor, rng, taken)
    receptacles.sort(key=lambda r: r.rid)

    object_types = frozenset(present & movable_types())
    fixed = _fixed_objects(present, receptacles, floor, rng)
    return Scene(
        number,
        room_of(number),
        tuple(receptacles),
        object_types,
        fixed,
        floor,
        _stands_on(receptacles),
        wanted is not None,
    )


def _complete(
    receptacles: list[Receptacle],
    wanted: Mapping[str, int],
    floor: tuple[tuple[float, float], ...],
    rng: random.Random,
    taken: set[str],
) -> list[Receptacle]:
    """The train split's receptacle list: trim types and counts it lacks, add what it has more of."""
    out: list[Receptacle] = []
    for rtype in sorted(wanted):
        have = sorted((r for r in receptacles if r.rtype == rtype), key=lambda r: r.rid)
        need = wanted[rtype]
        out.extend(have[:need])
        missing = need - len(have)
        if missing <= 0:
            continue
        if not have or rtype not in STACKED:
            out.extend(_synthesize(rtype, missing, floor, rng, taken))
            continue
        for k in range(missing):
            below = have[k % len(have)]
            x, y, z = below.position
            level = 1 + k // len(have)
            rid = make_id(rid_name(rtype), x, y + _STACK_STEP * level, z, basin_suffix(rtype))
            while rid in taken:
                y += 0.01
                rid = make_id(rid_name(rtype), x, y + _STACK_STEP * level, z, basin_suffix(rtype))
            taken.add(rid)
            out.append(Receptacle(rid, rtype, below.loc, False))
    return out


def rid_name(rtype: str) -> str:
    return _BASINS.get(rtype, rtype)


def basin_suffix(rtype: str) -> str:
    return rtype if rtype in _BASINS else ""


def _fixed_objects(
    present: set[str],
    receptacles: list[Receptacle],
    floor: tuple[tuple[float, float], ...],
    rng: random.Random,
) -> tuple[Placed, ...]:
    """Fixtures in the receptacle the train split puts them in most (drawn once per room), and
    floor objects on a floor point."""
    out: list[Placed] = []
    taken = {r.rid for r in receptacles}
    kinds = {r.rtype for r in receptacles}
    for otype in FIXTURES:
        weights = placement_counts().get(otype, {})
        homes = [t for t in sorted(weights) if t in kinds]
        if otype not in present or not homes:
            continue
        rtype = rng.choices(homes, weights=[weights[t] for t in homes], k=1)[0]
        home = rng.choice([r for r in receptacles if r.rtype == rtype])
        out.append(place_on(otype, home, rng, taken))
    for otype in FLOOR_OBJECTS:
        if otype not in present or not floor:
            continue
        x, z = rng.choice(floor)
        oid = make_id(otype, x + rng.uniform(-0.2, 0.2), rng.uniform(0.0, 0.3), z)
        if oid in taken:
            continue
        taken.add(oid)
        loc = pose_to_loc(x, z, rng.choice((0, 90, 180, 270)), 60)
        out.append(Placed(oid, otype, (), loc))
    return tuple(sorted(out, key=lambda p: p.oid))


def place_on(
    otype: str,
    receptacle: Receptacle,
    rng: random.Random,
    taken: set[str],
    also: tuple[Receptacle, ...] = (),
) -> Placed:
    """An instance of ``otype`` in ``receptacle`` (and in ``also``) with a fresh ALFRED id."""
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
            return Placed(oid, otype, (receptacle, *also), receptacle.loc)


def _stands_on(receptacles: list[Receptacle]) -> dict[str, str]:
    """Each coffee machine on its nearest counter or table (what is in it is on that too)."""
    surfaces = [r for r in receptacles if r.rtype in SURFACES]
    out: dict[str, str] = {}
    for r in receptacles:
        if r.rtype == "CoffeeMachine" and surfaces:
            out[r.rid] = min(surfaces, key=lambda s: (_distance(r, s), s.rid)).rid
    return out


def _distance(a: Receptacle, b: Receptacle) -> float:
    (ax, _, az), (bx, _, bz) = a.position, b.position
    return (ax - bx) ** 2 + (az - bz) ** 2


def _synthesize(
    rtype: str,
    count: int,
    floor: tuple[tuple[float, float], ...],
    rng: random.Random,
    taken: set[str],
) -> list[Receptacle]:
    height = _SYNTH_HEIGHT.get(rtype, 0.50)
    px, pz = rng.choice(floor)
    rotation = rng.choice((0, 90, 180, 270))
    # The receptacle stands 0.75 m in front of the pose (AI2-THOR: 0 deg faces +z, 90 deg faces +x).
    dx, dz = {0: (0.0, 0.75), 90: (0.75, 0.0), 180: (0.0, -0.75), 270: (-0.75, 0.0)}[rotation]
    horizon = 60 if height < 0.3 else (30 if height < 1.3 else 0)
    openable = rtype in ALWAYS_DOORS
    out: list[Receptacle] = []
    for k in range(count):
        # Burners come in rows of two, each row reached from its own spot.
        side = (k % 2) * 0.35 - 0.175 if count > 1 else 0.0
        depth = (k // 2) * 0.28 if count > 1 else 0.0
        ox = px + dx + (side if dz else depth)
        oz = pz + dz + (depth if dz else side)
        rid = make_id(rid_name(rtype), ox, height, oz, basin_suffix(rtype))
        while rid in taken:
            ox += 0.01
            rid = make_id(rid_name(rtype), ox, height, oz, basin_suffix(rtype))
        taken.add(rid)
        row_shift = (k // 2) * GRID if count > 1 else 0.0
        loc = pose_to_loc(
            px + (row_shift if dz else 0.0), pz + (0.0 if dz else row_shift), rotation, horizon
        )
        out.append(Receptacle(rid, rtype, loc, openable))
    return out
