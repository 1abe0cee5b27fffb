"""What an agent faces in a folder of ALFWorld games, counted the way ALFWorld's train split is.

:func:`read_games` reads every ``game.tw-pddl`` under a folder (real or generated; folders whose
path holds ``movable`` or ``Sliced`` are skipped, as ALFWorld's loader does) into
:class:`GameFacts`, counted from the PDDL problem's init facts, the walkthrough and the task
folder's name (``<type>-<object>-<movable receptacle>-<receptacle>-<scene>``):

- ``receptacles``: receptacle instances in the room;
- ``target_copies``: instances of the target's object type (on the floor too);
- ``behind_closed_door``: at least one copy starts in an openable receptacle (all start closed);
- ``in_goal_type``: at least one copy starts in a receptacle of the goal receptacle's type
  (an object in two receptacles, a mug in a coffee machine on a counter, starts in both).

Counted so, 32 of the 140 valid_seen games (23%) start with a target behind a closed door.

:func:`summarize` turns them into :class:`GameStats`; :func:`train_reference` gives the same
figures for ALFWorld's train split (3,553 games) from the packaged ``train_stats.json``;
:func:`format_report` prints one beside the other with their total-variation distances.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.discovery import TASK_TYPES, task_type_from_name
from envs.errors import EnvError

TRAIN_STATS = Path(__file__).with_name("train_stats.json")
SHORT_TYPES: tuple[str, ...] = tuple(TASK_TYPES.values())  # put clean heat cool examine puttwo
ROOM_TYPES: tuple[str, ...] = ("kitchen", "livingroom", "bedroom", "bathroom")
# Receptacles per room, binned (an agent feels 20 vs 30, not 21 vs 22).
RECEPTACLE_BINS: tuple[tuple[int, int], ...] = (
    (0, 10),
    (11, 15),
    (16, 20),
    (21, 25),
    (26, 30),
    (31, 35),
    (36, 999),
)
_FACT = re.compile(r"\((receptacleType|objectType|openable|inReceptacle) (\S+?)(?: (\S+?))?\)")

Combo = tuple[str, str, str, str]  # (short task type, object, movable receptacle, receptacle)


@dataclass(frozen=True)
class GameFacts:
    """One game's figures (see the module docstring for how each is counted)."""

    game_id: str
    task_type: str  # short name: put, clean, heat, cool, examine, puttwo
    target: str
    mrecep: str
    parent: str  # goal receptacle type ("DeskLamp" for examine)
    scene: int
    receptacles: int
    target_copies: int
    behind_closed_door: bool
    in_goal_type: bool
    walkthrough: int  # stored walkthrough's length (0 when the file has none)

    @property
    def room(self) -> str:
        return room_type(self.scene)

    @property
    def combo(self) -> Combo:
        return (self.task_type, self.target, self.mrecep, self.parent)


@dataclass(frozen=True)
class GameStats:
    """Counts per task type (short names), as in ALFWorld's ``alfworld_train_stats.json``."""

    games: int
    games_by_type: Mapping[str, int]
    rooms: Mapping[str, Mapping[str, float]]  # type -> room type -> games
    receptacles: Mapping[str, float]  # receptacle-count bin -> games
    mean_receptacles: float
    copies: Mapping[str, Mapping[int, float]]  # type -> target copies -> games
    closed: Mapping[str, float]  # type -> share behind a closed door
    goal: Mapping[str, float]  # type -> share in a goal-type receptacle
    walkthrough: Mapping[str, Mapping[int, float]]  # type -> length -> games
    combos_in_train: float  # share of games whose combination occurs in the train split


def room_type(scene: int) -> str:
    """ALFRED's numbering: 1-30 kitchens, 201-230 living rooms, 301-330 bedrooms, 401-430 baths."""
    for room, first in zip(ROOM_TYPES, (1, 201, 301, 401), strict=True):
        if first <= scene < first + 30:
            return room
    raise EnvError(f"scene {scene} is not an ALFRED room number (1-30, 201-230, 301-330, 401-430)")


def read_game(game_file: Path, root: Path) -> GameFacts:
    """The figures of one ``game.tw-pddl`` (its id is its trial folder relative to ``root``)."""
    try:
        data = json.loads(game_file.read_text())
        problem = data["pddl_problem"]
        walkthrough = data.get("walkthrough") or ()
        if not isinstance(problem, str) or not isinstance(walkthrough, list | tuple):
            raise TypeError("pddl_problem must be text and walkthrough a list")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EnvError(
            f"{str(game_file)!r} is not an ALFWorld game file ({exc.__class__.__name__})"
        ) from None
    game_id = game_file.parent.relative_to(root).as_posix()
    return game_facts(game_file.parent.parent.name, str(problem), len(walkthrough), game_id)


def game_facts(folder: str, problem: str, walkthrough: int, game_id: str = "") -> GameFacts:
    """The figures of a game from its task folder's name, PDDL problem and walkthrough length."""
    long_type = task_type_from_name(folder)
    parts = folder.split("-")
    if long_type is None or len(parts) != 5 or not parts[4].isdigit() or "(:init" not in problem:
        raise EnvError(
            f"{game_id or folder!r} is not an ALFWorld game in a task folder named "
            "<type>-<object>-<mrecep>-<recep>-<scene>: point at an ALFWorld data folder"
        )
    _, target, mrecep, parent, scene = parts
    init = problem.split("(:init", 1)[1].split("(:goal", 1)[0]
    rtype: dict[str, str] = {}
    copies: list[str] = []
    openable: set[str] = set()
    where: dict[str, list[str]] = {}
    for pred, a, b in _FACT.findall(init):
        if pred == "receptacleType":
            rtype[a] = b.removesuffix("Type")
        elif pred == "objectType" and b.removesuffix("Type") == target:
            copies.append(a)
        elif pred == "openable":
            openable.add(a)
        elif pred == "inReceptacle":
            where.setdefault(a, []).append(b)
    starts = [r for o in copies for r in where.get(o, ())]
    return GameFacts(
        game_id=game_id,
        task_type=TASK_TYPES[long_type],
        target=target,
        mrecep=mrecep,
        parent=parent,
        scene=int(scene),
        receptacles=len(rtype),
        target_copies=len(copies),
        behind_closed_door=any(r in openable for r in starts),
        in_goal_type=any(rtype.get(r) == parent for r in starts),
        walkthrough=walkthrough,
    )


def read_games(folder: str | Path) -> list[GameFacts]:
    """Every game under ``folder`` (any depth), sorted by id; :class:`EnvError` if there is none."""
    root = Path(folder)
    if not root.is_dir():
        raise EnvError(f"{str(root)!r} is not a folder: pass a folder of ALFWorld games")
    files = sorted(
        f
        for f in root.rglob("game.tw-pddl")
        if "movable" not in f.relative_to(root).as_posix()
        and "Sliced" not in f.relative_to(root).as_posix()
    )
    if not files:
        raise EnvError(f"no game.tw-pddl under {str(root)!r}: pass a folder of ALFWorld games")
    return [read_game(f, root) for f in files]


def summarize(games: Iterable[GameFacts], train_combos: Iterable[Combo] = ()) -> GameStats:
    """Counts of ``games``; ``combos_in_train`` against ``train_combos`` (the train split's if empty)."""
    facts = list(games)
    known = set(train_combos) or set(train_combo_counts())
    by_type: dict[str, list[GameFacts]] = {t: [] for t in SHORT_TYPES}
    for g in facts:
        by_type[g.task_type].append(g)
    present = {t: gs for t, gs in by_type.items() if gs}
    return GameStats(
        games=len(facts),
        games_by_type={t: len(gs) for t, gs in present.items()},
        rooms={t: _count(g.room for g in gs) for t, gs in present.items()},
        receptacles=_count(receptacle_bin(g.receptacles) for g in facts),
        mean_receptacles=sum(g.receptacles for g in facts) / max(len(facts), 1),
        copies={t: _count(g.target_copies for g in gs) for t, gs in present.items()},
        closed={t: _share(g.behind_closed_door for g in gs) for t, gs in present.items()},
        goal={t: _share(g.in_goal_type for g in gs) for t, gs in present.items()},
        walkthrough={
            t: _count(g.walkthrough for g in gs if g.walkthrough) for t, gs in present.items()
        },
        combos_in_train=_share(g.combo in known for g in facts),
    )


def receptacle_bin(count: int) -> str:
    for lo, hi in RECEPTACLE_BINS:
        if lo <= count <= hi:
            return f"{lo}-{hi}" if hi < 999 else f"{lo}+"
    return f"{count}"


@functools.cache
def train_stats() -> Mapping[str, object]:
    """ALFWorld's train-split statistics (``train_stats.json``, shipped with the package)."""
    with TRAIN_STATS.open() as f:
        data: Mapping[str, object] = json.load(f)
    return data


def train_combo_counts() -> dict[Combo, int]:
    """``(type, object, mrecep, receptacle) -> games`` of the train split."""
    rows = train_stats()["task_combos"]
    assert isinstance(rows, list)
    return {(t, o, m, r): int(n) for t, o, m, r, n in rows}


def train_scene_receptacles() -> dict[int, dict[str, int]]:
    """``scene -> receptacle type -> instances`` of every scene the train split uses."""
    scenes = train_stats()["receptacles_by_scene"]
    assert isinstance(scenes, dict)
    return {int(k): {t: int(n) for t, n in v.items()} for k, v in scenes.items()}


def train_reference() -> GameStats:
    """The train split's figures. Receptacles per room: the stats hold no games per scene, so each
    room type's games are spread evenly over its train scenes."""
    s = train_stats()
    by_type = _typed(s["games_by_task_type"])
    rooms = {t: _floats(v) for t, v in _typed(s["room_by_task_type"]).items()}
    per_room: dict[str, list[int]] = {}
    for number, counts in sorted(train_scene_receptacles().items()):
        per_room.setdefault(room_type(number), []).append(sum(counts.values()))
    receptacles: dict[str, float] = {}
    total = mean = 0.0
    for room_games in rooms.values():
        for room, games in room_games.items():
            sizes = per_room.get(room, [])
            for size in sizes:
                label = receptacle_bin(size)
                receptacles[label] = receptacles.get(label, 0.0) + games / len(sizes)
                mean += games * size / len(sizes)
            total += games if sizes else 0.0
    return GameStats(
        games=int(str(s["games"])),
        games_by_type={t: int(str(n)) for t, n in by_type.items()},
        rooms=rooms,
        receptacles=receptacles,
        mean_receptacles=mean / total if total else 0.0,
        copies={t: _floats(v, int) for t, v in _typed(s["target_copies_by_task_type"]).items()},
        closed=_floats(s["share_target_behind_closed_door"]),
        goal=_floats(s["share_target_starts_in_goal_receptacle_type"]),
        walkthrough={
            t: _floats(v, int) for t, v in _typed(s["walkthrough_length_by_task_type"]).items()
        },
        combos_in_train=1.0,
    )


def tv_distance(p: Mapping[Any, float], q: Mapping[Any, float]) -> float:
    """Total-variation distance of two count tables (each normalised to sum to 1)."""
    sp, sq = sum(p.values()), sum(q.values())
    if sp <= 0 or sq <= 0:
        return 1.0 if sp != sq else 0.0
    return 0.5 * sum(abs(p.get(k, 0.0) / sp - q.get(k, 0.0) / sq) for k in set(p) | set(q))


def distances(stats: GameStats, reference: GameStats) -> dict[str, float]:
    """Total-variation distance of every figure ``stats`` has, keyed ``figure`` or ``figure:type``.

    A share is a two-outcome distribution, so its distance is the shares' difference.
    """
    out = {"receptacles": tv_distance(stats.receptacles, reference.receptacles)}
    for t in SHORT_TYPES:
        if t not in stats.games_by_type:
            continue
        out[f"rooms:{t}"] = tv_distance(stats.rooms[t], reference.rooms.get(t, {}))
        out[f"copies:{t}"] = tv_distance(stats.copies[t], reference.copies.get(t, {}))
        out[f"closed:{t}"] = abs(stats.closed[t] - reference.closed.get(t, 0.0))
        out[f"goal:{t}"] = abs(stats.goal[t] - reference.goal.get(t, 0.0))
        out[f"walkthrough:{t}"] = tv_distance(
            stats.walkthrough[t], reference.walkthrough.get(t, {})
        )
    return out


def format_report(columns: Mapping[str, GameStats], reference: str = "") -> str:
    """A plain-text table, one column per named :class:`GameStats` (shares in %); when
    ``reference`` names one of them, each other column's total-variation distance to it follows
    on the first row of each figure."""
    names = list(columns)
    ref = columns.get(reference)
    others = [n for n in names if n != reference] if ref is not None else []
    width = max([14] + [len(n) + 2 for n in names])
    head = f"{'figure':38}" + "".join(f"{n:>{width}}" for n in names)
    lines = [head + "".join(f"{'TV ' + n:>{width + 3}}" for n in others)]

    def row(label: str, cells: list[str], key: str = "") -> None:
        text = f"{label:38}" + "".join(f"{c:>{width}}" for c in cells)
        if key and ref is not None:  # "-": a column without games of that type has none
            found = [distances(columns[n], ref).get(key) for n in others]
            text += "".join(
                f"{'-':>{width + 3}}" if d is None else f"{d:>{width + 3}.3f}" for d in found
            )
        lines.append(text)

    def table(label: str, key: str, tables: list[Mapping[Any, float]]) -> None:
        values = sorted({v for t in tables for v in t}, key=_order)
        for i, value in enumerate(values):
            cells = [_pct(t.get(value, 0.0) / sum(t.values())) if t else "-" for t in tables]
            row(f"{label if i == 0 else '':26}{value!s:>12}", cells, key if i == 0 else "")

    row("games", [str(columns[n].games) for n in names])
    for t in SHORT_TYPES:
        row(f"  {t}", [str(columns[n].games_by_type.get(t, 0)) for n in names])
    row("receptacles per room, mean", [f"{columns[n].mean_receptacles:.1f}" for n in names])
    table("receptacles per room", "receptacles", [columns[n].receptacles for n in names])
    row("combination in train split", [_pct(columns[n].combos_in_train) for n in names])
    for t in SHORT_TYPES:
        if not any(t in columns[n].games_by_type for n in names):
            continue
        lines.append(f"-- {t}")
        table("  room", f"rooms:{t}", [columns[n].rooms.get(t, {}) for n in names])
        table("  target copies", f"copies:{t}", [columns[n].copies.get(t, {}) for n in names])
        row(
            "  behind a closed door",
            [_pct(columns[n].closed.get(t)) for n in names],
            f"closed:{t}" if t in columns[names[0]].games_by_type else "",
        )
        row(
            "  in a goal-type receptacle",
            [_pct(columns[n].goal.get(t)) for n in names],
            f"goal:{t}" if t in columns[names[0]].games_by_type else "",
        )
        table(
            "  walkthrough length",
            f"walkthrough:{t}",
            [columns[n].walkthrough.get(t, {}) for n in names],
        )
    return "\n".join(lines)


def stats_report(folder: str | Path) -> str:
    """``reflexsim games stats DIR``: the folder's figures beside the train split's, with distances."""
    return format_report(
        {str(folder): summarize(read_games(folder)), "train split": train_reference()},
        reference="train split",
    )


def _count(values: Iterable[Any]) -> dict[Any, float]:
    return {k: float(v) for k, v in Counter(values).items()}


def _share(flags: Iterable[bool]) -> float:
    items = list(flags)
    return sum(items) / len(items) if items else 0.0


def _typed(value: object) -> dict[str, object]:
    assert isinstance(value, dict)
    return {str(k): v for k, v in value.items()}


def _floats(value: object, key: Callable[[str], Any] = str) -> dict[Any, float]:
    assert isinstance(value, dict)
    return {key(k): float(v) for k, v in value.items()}


def _order(value: Any) -> tuple[int, str]:
    """Numbers and bins (``16-20``, ``36+``) by value, names alphabetically."""
    head = str(value).split("-")[0].rstrip("+")
    return (int(head), "") if head.isdigit() else (10**6, str(value))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
