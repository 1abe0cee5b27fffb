"""``generate()``: new ALFWorld games, each planned, replayed to a win, then written.

Per game: the (seed, task type, index) point of a low-discrepancy sequence picks the room type,
the target's copies, whether it starts behind a closed door or in a goal-type receptacle, and
the walkthrough length (see :mod:`envs.alfgen.tasks`); a ``random.Random`` stream derived from
(seed, task type, index, attempt) draws the rest, and draws whose shortest plan has another
length are redrawn before planning; fast-downward (TextWorld's ``PddlState.replan``) plans it on the goal's
projection of the problem (see :func:`envs.alfgen.pddl.render_problem`: seconds instead of up to a
minute per kitchen); the plan, as ALFWorld 0.4 commands, is played through
:class:`envs.alfworld_env.ALFWorldEnv` on the finished, full game files and must end in ``won``. A draw that fails any step is replaced by the next attempt's draw.
Files carry no timestamps and every collection is iterated sorted, so a seed always writes the
same bytes; game ``i`` of a type does not depend on ``per_type``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.alfgen import pddl
from envs.alfgen.scenes import UNSEEN_EVAL_SCENES, Scene, available_scenes, load_scene
from envs.alfgen.stats import train_scene_receptacles
from envs.alfgen.tasks import (
    NoTask,
    Task,
    controls_for,
    pick_scene,
    sample_task,
    scene_fits,
    shortest_plan,
)
from envs.alfworld_env import ALFWorldEnv
from envs.discovery import SPLITS, normalize_task_types
from envs.errors import EnvError

MAX_ATTEMPTS = 50


@dataclass(frozen=True)
class GameFiles:
    """One finished game: where it goes (relative to the data root) and its files' bytes."""

    game_id: str  # json_2.1.1/<split>/<task folder>/<trial>
    game: bytes  # game.tw-pddl
    traj: bytes  # traj_data.json
    task: Task
    walkthrough: tuple[str, ...]
    attempt: int


# games per task type one call makes at most (a typo's 10**9 would write for days, unbounded)
MAX_PER_TYPE = 10_000


def check_per_type(per_type: int) -> None:
    """:class:`EnvError` for more games per task type than one call makes."""
    if per_type > MAX_PER_TYPE:
        raise EnvError(
            f"{per_type} games per task type is over the limit of {MAX_PER_TYPE}: ask for "
            f"{MAX_PER_TYPE} or fewer"
        )


def generate(
    out_dir: str | Path,
    per_type: int,
    seed: int,
    task_types: list[str] | None = None,
    split: str = "train",
) -> list[Path]:
    """Write ``per_type`` new games of each task type under ``out_dir`` (``$ALFWORLD_DATA`` layout).

    Returns the written ``game.tw-pddl`` paths. Bad arguments raise :class:`EnvError`.
    """
    types = normalize_task_types(task_types)
    if isinstance(per_type, bool) or not isinstance(per_type, int) or per_type <= 0:
        raise EnvError(f"per_type must be a whole number > 0, got {per_type!r}")
    check_per_type(per_type)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise EnvError(f"seed must be a whole number >= 0, got {seed!r}")
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    root = _writable_root(out_dir)

    maker = GameMaker(split)
    written: list[Path] = []
    with maker:
        for task_type in types:
            for index in range(per_type):
                files = maker.make(task_type, seed, index)
                written.append(write_game(root, files))
    return written


def write_game(root: Path, files: GameFiles) -> Path:
    trial = root / files.game_id
    try:
        trial.mkdir(parents=True, exist_ok=True)
        (trial / "game.tw-pddl").write_bytes(files.game)
        (trial / "traj_data.json").write_bytes(files.traj)
    except OSError as exc:
        raise EnvError(f"cannot write games under {str(root)!r} ({exc.strerror or exc})") from None
    return trial / "game.tw-pddl"


def _writable_root(out_dir: str | Path) -> Path:
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise EnvError(
            f"out dir {str(root)!r} is a file: pass a directory (it is created if missing)"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".alfgen-probe-"):
            pass
    except OSError as exc:
        raise EnvError(
            f"out dir {str(root)!r} is not writable ({exc.strerror or exc}): pick another --out"
        ) from None
    return root


def stream(seed: int, task_type: str, index: int, attempt: int) -> random.Random:
    """The random stream of one draw; independent of every other game's."""
    digest = hashlib.sha256(f"alfgen:{seed}:{task_type}:{index}:{attempt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def trial_name(seed: int, index: int) -> str:
    return f"trial_T{seed}_{index:04d}"


def scenes_for(split: str, task_type: str) -> list[int]:
    """Rooms a split may use: the OOD split only ALFRED's unseen rooms, the others the rooms of
    ALFWorld's train split (never the unseen ones); only those that can host ``task_type``."""
    unseen = set(UNSEEN_EVAL_SCENES)
    if split == "eval_out_of_distribution":
        pool = [n for n in available_scenes() if n in unseen]
    else:
        train = train_scene_receptacles()
        pool = [n for n in available_scenes() if n in train and n not in unseen]
    return [n for n in pool if scene_fits(load_scene(n), task_type)]


class GameMaker:
    """Samples, plans and verifies games; holds one planner (grammar parsed once) per run."""

    def __init__(self, split: str) -> None:
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
        self.split = split
        self._planner: _Planner | None = None
        self._stage: tempfile.TemporaryDirectory[str] | None = None
        self._guard = contextlib.ExitStack()
        self._pools: dict[str, list[Scene]] = {}

    def __enter__(self) -> GameMaker:
        self._guard.enter_context(_third_party_side_effects())
        self._stage = tempfile.TemporaryDirectory(prefix="alfgen-")
        self._guard.callback(self._stage.cleanup)
        return self

    def __exit__(self, *exc: object) -> None:
        self._guard.close()
        self._stage = None

    def make(self, task_type: str, seed: int, index: int) -> GameFiles:
        trial = trial_name(seed, index)
        for attempt, task, length in self.drafts(task_type, seed, index):
            walkthrough = self.planner().plan(pddl.render_problem(task, trial, planning=True))
            if not walkthrough or (length and len(walkthrough) != length):
                continue
            files = self._build(task, trial, walkthrough, seed, index, attempt)
            if self._replay_wins(files):
                return files
        raise EnvError(
            f"could not make a winnable {task_type} game #{index} for seed {seed} in {MAX_ATTEMPTS} draws"
        )

    def drafts(self, task_type: str, seed: int, index: int) -> Iterator[tuple[int, Task, int]]:
        """Game ``index``'s draws, not yet planned, whose shortest plan has the walkthrough length
        the game draws: ``(attempt, task, length)`` (length 0: any)."""
        for attempt in range(MAX_ATTEMPTS):
            rng = stream(seed, task_type, index, attempt)
            controls = controls_for(seed, task_type, index).redrawn(rng, attempt)
            scene = pick_scene(self.pool(task_type), task_type, controls)
            try:
                task = sample_task(scene, task_type, rng, controls)
            except NoTask:
                continue
            if controls.length and shortest_plan(task) != controls.length:
                continue  # not the length this game draws: redraw before planning
            yield attempt, task, controls.length

    def pool(self, task_type: str) -> list[Scene]:
        """The rooms this split's games of ``task_type`` are drawn from."""
        if task_type not in self._pools:
            numbers = scenes_for(self.split, task_type)
            if not numbers:
                raise EnvError(f"no ALFRED room can host {task_type} in split {self.split!r}")
            self._pools[task_type] = [load_scene(n) for n in numbers]
        return self._pools[task_type]

    def planner(self) -> _Planner:
        if self._planner is None:
            self._planner = _Planner()
        return self._planner

    def _build(
        self, task: Task, trial: str, walkthrough: list[str], seed: int, index: int, attempt: int
    ) -> GameFiles:
        domain, _ = pddl.alfworld_logic()
        game = {
            "pddl_domain": domain,
            "grammar": pddl.grammar_for(task),
            "pddl_problem": pddl.render_problem(task, trial),
            "solvable": True,
            "walkthrough": walkthrough,
        }
        traj = {
            "task_type": task.task_type,
            "task_id": trial,
            "pddl_params": task.pddl_params(),
            "scene": {"floor_plan": task.scene.floor_plan, "scene_num": task.scene.number},
            "generator": {"seed": seed, "index": index, "attempt": attempt},
        }
        game_id = f"{SPLITS[self.split]}/{task.folder_name}/{trial}"
        return GameFiles(
            game_id,
            json.dumps(game).encode(),
            (json.dumps(traj, indent=2, sort_keys=True) + "\n").encode(),
            task,
            tuple(walkthrough),
            attempt,
        )

    def _replay_wins(self, files: GameFiles) -> bool:
        """Play the walkthrough through ALFWorldEnv on the written files: must end in ``won``."""

        assert self._stage is not None, "use GameMaker as a context manager"
        root = Path(self._stage.name) / hashlib.sha256(files.game_id.encode()).hexdigest()[:16]
        write_game(root, files)
        env = ALFWorldEnv(
            data_dir=root,
            split=self.split,
            games=[files.game_id],
            max_steps=len(files.walkthrough) + 1,
        )
        try:
            _, info = env.reset(options={"game": files.game_id})
            if info["won"] or info["task"] != files.task.sentence:
                return False
            for command in files.walkthrough:
                if command not in info["admissible_commands"]:
                    return False
                _, _, _, _, info = env.step(command)
            return bool(info["won"])
        finally:
            env.close()
            shutil.rmtree(root, ignore_errors=True)


class _Planner:
    """fast-downward through TextWorld: ``PddlState(...).replan`` with ALFWorld's entity names."""

    def __init__(self) -> None:
        # heavy: the planner and textworld, only to make games
        import fast_downward
        from textworld.envs.pddl import logic as pddl_logic

        domain, grammar = pddl.alfworld_logic()
        self._logic_mod = pddl_logic
        self._lib = fast_downward.load_lib()
        self._logic = pddl_logic.GameLogic(domain=domain, grammar=grammar)

    def plan(self, problem: str) -> list[str]:
        # heavy: alfworld and textworld, only to make games
        from alfworld.agents.utils.misc import Demangler
        from textworld.generator.game import EntityInfo

        state = self._logic_mod.PddlState(self._lib, problem, self._logic)
        infos: dict[str, Any] = {}
        for fact in state.facts:
            for var in fact.arguments:
                infos.setdefault(var.name, EntityInfo(var.name, var.type))
        demangler = Demangler(game_infos=infos, shuffle=False)
        for info in infos.values():
            info.name = demangler.demangle_alfred_name(info.id)
        return list(state.replan(infos))


@contextlib.contextmanager
def _third_party_side_effects() -> Iterator[None]:
    """Undo what the engine's imports and translator do to the process.

    fast-downward's translator overwrites ``sys.argv``; importing alfworld sets
    ``$ALFWORLD_DATA`` (to ``~/.cache/alfworld``) when it is unset, which would silently change
    where ``ALFWorldEnv()`` looks for games afterwards.
    """
    argv = list(sys.argv)
    had_data = "ALFWORLD_DATA" in os.environ
    old_data = os.environ.get("ALFWORLD_DATA")
    try:
        yield
    finally:
        sys.argv[:] = argv
        if had_data and old_data is not None:
            os.environ["ALFWORLD_DATA"] = old_data
        else:
            os.environ.pop("ALFWORLD_DATA", None)
