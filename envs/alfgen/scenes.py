"""ALFRED floor plans as the alfworld package ships them, turned into text-game rooms.

A room's receptacle types and object types come from ``FloorPlan<N>-objects.json``; receptacle
instances (real AI2-THOR ids) and the pose the agent takes to use them from
``FloorPlan<N>-openable.json``; reachable floor points from ``FloorPlan<N>-layout.npy``.
Receptacles a room has but that file does not place (stove burners, coffee machines, toasters,
most garbage cans, towel holders...) get deterministic made-up instances, so a room always has
the same furniture whatever game is generated in it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.errors import EnvError

GRID = 0.25  # AI2-THOR's navigation step, in metres; ALFWorld locations count in steps

ROOMS: dict[str, range] = {
    "Kitchen": range(1, 31),
    "LivingRoom": range(201, 231),
    "Bedroom": range(301, 331),
    "Bathroom": range(401, 431),
}
# ALFRED's valid_unseen rooms, i.e. ALFWorld's eval_out_of_distribution split: games for the other
# splits never use them, so a generated train game never shows an agent an OOD-evaluation room.
UNSEEN_EVAL_SCENES: tuple[int, ...] = (10, 219, 308, 424)

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
_BASINS = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}


@dataclass(frozen=True)
class Receptacle:
    """A static receptacle: its ALFRED id (``Cabinet|+00.68|+00.50|-02.20``), type and location."""

    rid: str
    rtype: str
    loc: tuple[int, int, int, int]  # x, z (grid steps), rotation (quarter turns), camera horizon

    @property
    def position(self) -> tuple[float, float, float]:
        x, y, z = (float(v) for v in self.rid.split("|")[1:4])
        return x, y, z


@dataclass(frozen=True)
class Scene:
    """One ALFRED room: its receptacles, the object types it holds, its free floor points."""

    number: int
    room: str
    receptacles: tuple[Receptacle, ...]
    object_types: frozenset[str]
    floor: tuple[tuple[float, float], ...]

    @property
    def floor_plan(self) -> str:
        return f"FloorPlan{self.number}"

    def receptacle_types(self) -> frozenset[str]:
        return frozenset(r.rtype for r in self.receptacles)

    def of_type(self, rtype: str) -> list[Receptacle]:
        return [r for r in self.receptacles if r.rtype == rtype]


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


def pose_to_loc(x: float, z: float, rotation: float, horizon: float) -> tuple[int, int, int, int]:
    return (
        int(round(x / GRID)),
        int(round(z / GRID)),
        int(round(rotation / 90.0)) % 4,
        int(round(horizon)),
    )


def static_receptacle_types() -> frozenset[str]:
    c = constants()
    return frozenset(t for t in c.VAL_RECEPTACLE_OBJECTS if t not in c.MOVABLE_RECEPTACLES_SET)


def pickupable_types() -> frozenset[str]:
    """Every object type that some receptacle can hold (ALFRED's placement table)."""
    c = constants()
    out: set[str] = set()
    for held in c.VAL_RECEPTACLE_OBJECTS.values():
        out.update(t for t in held if not t.endswith("Sliced"))
    return frozenset(out)


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
    import numpy as np

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

    receptacles: list[Receptacle] = []
    for rid in sorted(poses):
        parts = rid.split("|")
        rtype = parts[-1] if parts[-1] in _BASINS else parts[0]
        if rtype not in static:
            continue
        x, z, rotation, horizon = poses[rid]
        receptacles.append(Receptacle(rid, rtype, pose_to_loc(x, z, rotation, horizon)))

    placed = {r.rtype for r in receptacles}
    rng = _stream("scene", number)
    for rtype in sorted(static & present - placed):
        receptacles.extend(_synthesize(rtype, floor, rng, {r.rid for r in receptacles}))

    object_types = frozenset(present & pickupable_types())
    if "DeskLamp" in present:
        object_types = object_types | {"DeskLamp"}
    return Scene(number, room_of(number), tuple(receptacles), object_types, floor)


def _synthesize(
    rtype: str, floor: tuple[tuple[float, float], ...], rng: random.Random, taken: set[str]
) -> list[Receptacle]:
    count = _SYNTH_COUNT.get(rtype, 1)
    height = _SYNTH_HEIGHT.get(rtype, 0.50)
    px, pz = rng.choice(floor)
    rotation = rng.choice((0, 90, 180, 270))
    # The receptacle stands 0.75 m in front of the pose (AI2-THOR: 0 deg faces +z, 90 deg faces +x).
    dx, dz = {0: (0.0, 0.75), 90: (0.75, 0.0), 180: (0.0, -0.75), 270: (-0.75, 0.0)}[rotation]
    horizon = 60 if height < 0.3 else (30 if height < 1.3 else 0)
    out: list[Receptacle] = []
    for k in range(count):
        # Burners come in rows of two, each row reached from its own spot.
        side = (k % 2) * 0.35 - 0.175 if count > 1 else 0.0
        depth = (k // 2) * 0.28 if count > 1 else 0.0
        ox = px + dx + (side if dz else depth)
        oz = pz + dz + (depth if dz else side)
        name = _BASINS.get(rtype, rtype)
        rid = make_id(name, ox, height, oz, rtype if rtype in _BASINS else "")
        while rid in taken:
            ox += 0.01
            rid = make_id(name, ox, height, oz, rtype if rtype in _BASINS else "")
        taken.add(rid)
        row_shift = (k // 2) * GRID if count > 1 else 0.0
        loc = pose_to_loc(
            px + (row_shift if dz else 0.0), pz + (0.0 if dz else row_shift), rotation, horizon
        )
        out.append(Receptacle(rid, rtype, loc))
    return out
