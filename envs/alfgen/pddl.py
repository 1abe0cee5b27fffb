"""Write a sampled task as ALFWorld's TextWorld-PDDL: the problem, the domain and the grammar.

The problem has the layout of ALFWorld's released game files (every ALFRED type declared, then
the instances, receptacles and locations; facts grouped by predicate; the goal from ALFWorld's
goal library). Ids use ALFRED's mangling (``|`` as ``_bar_``, ``-`` as ``_minus_``...), which
ALFWorld's demangler turns into "apple 1", "sinkbasin 1".

Domain and grammar are the alfworld package's ``alfred.pddl`` / ``alfred.twl2`` in the exact form
the released games embed them: the task line filled in, the help text inlined, and the domain's
``SinkType`` cleaning line enabled. If a future alfworld ships different files, they are used as
shipped (the games stay valid; only the byte-level match with the released games is lost).
"""

from __future__ import annotations

import functools
import json
import re

from envs.alfgen.scenes import NOT_PICKUPABLE, constants
from envs.alfgen.tasks import LAMP, Task, goal_pddl

_MANGLE = str.maketrans({"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"})
IND = "\n        "


def mangle(alfred_id: str) -> str:
    """``Apple|-01.96|+00.95|+00.46`` -> ``Apple_bar__minus_01_dot_96_bar__plus_00_dot_95...``."""
    return alfred_id.translate(_MANGLE)


def loc_name(loc: tuple[int, int, int, int]) -> str:
    return mangle("loc|" + "|".join(str(v) for v in loc))


def _type_header() -> tuple[list[str], list[str]]:
    c = constants()
    static = set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)
    objects = sorted(set(c.OBJECTS_SET) - static)
    return objects, sorted(static)


def render_problem(task: Task, problem_id: str, planning: bool = False) -> str:
    """The ``pddl_problem`` text of ``task``.

    ``planning=True`` keeps only what the goal can depend on (the target-type objects, the lamp,
    every receptacle and location): fast-downward's search on a full kitchen can take a minute,
    on this projection well under a second. Any plan for the projection is a plan for the full
    game, since other objects never block an action; the caller replays it on the full game.
    """
    c = constants()
    keep = {task.target, LAMP} if planning else None
    objects = [p for p in task.objects if keep is None or p.otype in keep]
    receptacles = sorted(task.scene.receptacles, key=lambda r: r.rid)
    locations = sorted({r.loc for r in receptacles} | {p.loc for p in objects} | {task.agent_loc})

    type_objects, type_receps = _type_header()
    decl_types = (
        IND.join(f"{t} - object" for t in type_objects)
        + "\n"
        + IND.join(f"{t}Type - otype" for t in type_objects)
        + "\n"
        + IND.join(f"{t}Type - rtype" for t in type_receps)
    )
    decl = IND.join(
        [f"{mangle(p.oid)} - object" for p in objects]
        + [f"{mangle(r.rid)} - receptacle" for r in receptacles]
        + [f"{loc_name(loc)} - location" for loc in locations]
    )

    holds = c.VAL_RECEPTACLE_OBJECTS
    present = sorted({p.otype for p in objects})
    contain = sorted(
        {(r.rtype, t) for r in receptacles for t in present if t in holds.get(r.rtype, ())}
    )
    able = c.VAL_ACTION_OBJECTS
    pick = [p for p in objects if p.otype not in NOT_PICKUPABLE]

    def facts(pred: str, items: list[str]) -> str:
        return IND.join(f"({pred} {x})" for x in items)

    groups = [
        IND.join(f"(receptacleType {mangle(r.rid)} {r.rtype}Type)" for r in receptacles),
        IND.join(f"(objectType {mangle(p.oid)} {p.otype}Type)" for p in objects),
        IND.join(f"(canContain {rt}Type {ot}Type)" for rt, ot in contain),
        facts("pickupable", [mangle(p.oid) for p in pick]),
        facts(
            "isReceptacleObject",
            [mangle(p.oid) for p in pick if p.otype in c.MOVABLE_RECEPTACLES_SET],
        ),
        facts(
            "openable",
            [mangle(r.rid) for r in receptacles if r.openable],
        ),
        "",
        f"(atLocation agent1 {loc_name(task.agent_loc)})",
        "",
        facts("cleanable", [mangle(p.oid) for p in pick if p.otype in able["Cleanable"]]),
        "",
        facts("heatable", [mangle(p.oid) for p in pick if p.otype in able["Heatable"]]),
        facts("coolable", [mangle(p.oid) for p in pick if p.otype in able["Coolable"]]),
        "",
        facts("toggleable", [mangle(p.oid) for p in objects if p.otype in able["Toggleable"]]),
        "",
        facts("sliceable", [mangle(p.oid) for p in pick if p.otype in able["Sliceable"]]),
        "",
        IND.join(
            f"(inReceptacle {mangle(p.oid)} {mangle(r.rid)})"
            for p in objects
            for r in p.receptacles
        ),
        "",
        IND.join(f"(receptacleAtLocation {mangle(r.rid)} {loc_name(r.loc)})" for r in receptacles),
        IND.join(f"(objectAtLocation {mangle(p.oid)} {loc_name(p.loc)})" for p in objects),
    ]
    init = IND.join(groups)
    return (
        f"\n(define (problem plan_{problem_id})\n(:domain alfred)\n(:objects\nagent1 - agent\n"
        f"{decl_types}\n\n{IND}{decl}\n        )\n    \n\n(:init\n\n{IND}{init}\n"
        f"        )\n    \n{goal_pddl(task)}"
    )


@functools.lru_cache(maxsize=1)
def alfworld_logic() -> tuple[str, str]:
    """(pddl_domain, grammar template with ``UNKNOWN GOAL``) in the released games' form."""
    from alfworld import info  # heavy: alfworld, only to play or make a game

    with open(info.ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(info.ALFRED_TWL2_PATH) as f:
        grammar = f.read()
    return _released_domain(domain), _released_grammar(grammar)


def _released_domain(domain: str) -> str:
    sink = ";(receptacleType ?r SinkType)"
    if domain.count(sink) == 1 and domain.endswith(")\n\n)\n"):
        domain = domain.replace(sink, sink[1:])
        domain = domain[: -len(")\n\n)\n")] + ")\n)\n"
    return domain


_HELP = re.compile(
    r'feedback :: "#help\.feedback#";\n\n    grammar :: """\s*\{\s*"help\.feedback": \[\s*\{\s*'
    r'"rhs": ("(?:[^"\\]|\\.)*")\s*\}\s*\]\s*\}\s*""";\n\}\n$'
)


def _released_grammar(grammar: str) -> str:
    match = _HELP.search(grammar)
    if match:
        text = json.loads(match.group(1))
        grammar = grammar[: match.start()] + f'feedback :: "{text}";\n}}\n'
    return grammar


def grammar_for(task: Task) -> str:
    _, template = alfworld_logic()
    return template.replace("UNKNOWN GOAL.", task.sentence)
