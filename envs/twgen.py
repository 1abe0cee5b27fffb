"""Generate household TextWorld games offline with TextWorld's own generator and Inform 7.

``generate_textworld_games(out_dir, n, seed, challenge)`` writes ``n`` games (``<uuid>.z8`` plus
the ``<uuid>.json`` TextWorld needs to track them, which keeps the walkthrough) for the
``tw-simple`` or ``tw-cooking`` challenge. Output is byte-for-byte deterministic given the seed and
options: generation runs in a child interpreter with a fixed ``PYTHONHASHSEED`` (TextWorld orders
some sets by string hash), and the compile date Inform writes into the story header is replaced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from envs.errors import EnvError

CHALLENGES = ("tw-simple", "tw-cooking")
# Challenge settings and their defaults; tw-cooking defaults to one ingredient to fetch.
DEFAULTS: dict[str, dict[str, Any]] = {
    "tw-simple": {"rewards": "dense", "goal": "detailed", "test": False},
    "tw-cooking": {
        "recipe": 1,
        "take": 1,
        "go": 1,
        "open": False,
        "cook": False,
        "cut": False,
        "drop": False,
        "recipe_seed": 0,
        "split": None,
    },
}
CHOICES: dict[str, tuple[Any, ...]] = {
    "rewards": ("dense", "balanced", "sparse"),
    "goal": ("detailed", "brief", "none"),
    "go": (1, 6, 9, 12),
    "split": (None, "train", "valid", "test"),
}
SERIAL = b"000000"  # Z-machine header bytes 0x12-0x17: Inform's compile date, YYMMDD
SECONDS_PER_GAME = 120


def challenge_settings(challenge: str, **options: Any) -> dict[str, Any]:
    """The full settings of a challenge: defaults overridden by ``options``, checked."""
    if challenge not in DEFAULTS:
        raise EnvError(
            f"unknown TextWorld challenge {challenge!r}: use one of {', '.join(CHALLENGES)}"
        )
    settings = dict(DEFAULTS[challenge])
    unknown = sorted(set(options) - set(settings))
    if unknown:
        raise EnvError(
            f"unknown option {unknown[0]!r} for {challenge}: use {', '.join(sorted(settings))}"
        )
    for key, value in options.items():
        default = settings[key]
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise EnvError(f"{challenge} option {key}={value!r}: use one of {CHOICES[key]}")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise EnvError(f"{challenge} option {key}={value!r}: expected True or False")
        elif isinstance(default, int) and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise EnvError(f"{challenge} option {key}={value!r}: expected an integer >= 0")
        settings[key] = value
    if challenge == "tw-cooking":
        if not 1 <= settings["recipe"] <= 5:
            raise EnvError(f"tw-cooking option recipe={settings['recipe']}: use 1 to 5 ingredients")
        if settings["take"] > settings["recipe"]:
            raise EnvError(
                f"tw-cooking option take={settings['take']} exceeds recipe={settings['recipe']}"
            )
        if settings["recipe_seed"] and not settings["take"]:
            raise EnvError("tw-cooking option recipe_seed needs take >= 1")
    return settings


def game_seeds(seed: int, n: int) -> list[int]:
    """Per-game seeds: game ``i`` depends only on (seed, i), so a longer run extends a shorter."""
    children = np.random.SeedSequence(seed).spawn(n)
    return [int(c.generate_state(1, dtype=np.uint32)[0]) for c in children]


def generate_textworld_games(
    out_dir: str | os.PathLike[str],
    n: int,
    seed: int,
    challenge: str = "tw-simple",
    timeout_s: float | None = None,
    **options: Any,
) -> list[Path]:
    """Generate ``n`` games of ``challenge`` into ``out_dir``; returns the ``.z8`` paths in order.

    ``options`` are the challenge's settings (see ``DEFAULTS``), e.g. ``goal="brief"`` for
    tw-simple or ``go=6, open=True, cook=True`` for tw-cooking. Existing files of the same name
    are overwritten (with identical bytes, when seed and options are the same).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EnvError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise EnvError(f"seed must be an integer >= 0, got {seed!r}")
    settings = challenge_settings(challenge, **options)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvError(f"cannot create output dir {str(out)!r} ({exc.strerror})") from None
    with tempfile.TemporaryDirectory(prefix="twgen-") as tmp:
        result_file = Path(tmp) / "result.json"
        spec = {
            "challenge": challenge,
            "settings": settings,
            "seeds": game_seeds(seed, n),
            "out_dir": str(out.resolve()),
            "result": str(result_file),
        }
        _run_worker(spec, timeout_s if timeout_s is not None else 60 + SECONDS_PER_GAME * n)
        paths = [Path(p) for p in json.loads(result_file.read_text())]
    return paths


def _run_worker(spec: dict[str, Any], timeout_s: float) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    code = "import envs.twgen as g; g._worker()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=spec["out_dir"],
        )
    except subprocess.TimeoutExpired:
        raise EnvError(
            f"TextWorld game generation took over {timeout_s:.0f} s: generate fewer games at once"
        ) from None
    result_file = Path(spec["result"])
    result = json.loads(result_file.read_text()) if result_file.is_file() else None
    if isinstance(result, dict) or proc.returncode != 0 or result is None:
        if isinstance(result, dict):
            reason = str(result.get("error"))
        else:
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise EnvError(f"TextWorld game generation failed: {reason[:300]}")


def _worker() -> None:
    """Child side: read the spec from stdin, generate and compile each game, write the result.

    The result file holds the list of game paths, or ``{"error": one line}``.
    """
    spec = json.loads(sys.stdin.read())
    paths: list[str] = []
    result: Any = paths
    for i, game_seed in enumerate(spec["seeds"]):
        try:
            paths.append(_make_one(spec["challenge"], spec["settings"], game_seed, spec["out_dir"]))
        except Exception as exc:  # reported to the parent as one line
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = " / ".join(lines[:4])
            result = {"error": f"game {i} (seed {game_seed}): {exc.__class__.__name__}: {detail}"}
            break
    Path(spec["result"]).write_text(json.dumps(result))


def _make_one(challenge: str, settings: dict[str, Any], game_seed: int, out_dir: str) -> str:
    # heavy: textworld, only to play or make a game
    import textworld.challenges
    from textworld import GameOptions
    from textworld.generator import compile_game

    options = GameOptions()
    options.seeds = game_seed
    options.file_ext = ".z8"
    options.force_recompile = True
    options.path = out_dir + os.sep  # a folder: TextWorld names the file by the game's uuid
    game = textworld.challenges.CHALLENGES[challenge][1](dict(settings), options)
    if not game.metadata.get("walkthrough") and game.walkthrough:
        game.metadata["walkthrough"] = list(game.walkthrough)
    game_file = Path(compile_game(game, options))
    _pin_serial(game_file)
    game_file.with_suffix(".ni").unlink(missing_ok=True)  # the Inform source, not needed
    return str(game_file)


def _pin_serial(game_file: Path) -> None:
    # The header is outside the checksummed range (0x40 onwards), so the checksum stays valid.
    data = bytearray(game_file.read_bytes())
    data[0x12:0x18] = SERIAL
    game_file.write_bytes(bytes(data))
