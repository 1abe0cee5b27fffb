"""A damaged run store and a full disk: every command that opens a store says so in one line
(exit 2, no traceback), a resume never plays on a damaged store, and a run stopped by a full disk
finishes on ``--resume`` once space is freed, with nothing lost."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.errors import StoreDamagedError, StoreFullError
from experiments.store import DB_NAME, RunStore, open_reader
from tests.experiments.test_runner import SPLIT, snapshot, steps_written
from tests.support.runfactory import make_run, many_tasks

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = 4096


def reflexsim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "experiments.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def one_line_error(r: subprocess.CompletedProcess[str], needle: str) -> str:
    """The command failed with exit 2 and one ``reflexsim: error:`` line naming ``needle``."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("reflexsim: error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-3000:]
    return errors[0]


def _garbage(path: Path) -> None:
    """8 KiB of random bytes over two pages in the middle of the file."""
    data = bytearray(path.read_bytes())
    at = (len(data) // 2) // PAGE * PAGE
    data[at : at + 2 * PAGE] = random.Random(7).randbytes(2 * PAGE)
    path.write_bytes(bytes(data))


def _garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:100] = random.Random(8).randbytes(100)
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size * 3 // 5)


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run store of many pages (the standard tasks, each played by many games)."""
    return make_run(tmp_path_factory.mktemp("stores") / "run", many_tasks(8))


@pytest.mark.parametrize(
    "damage", [_garbage, _garbage_header, _truncate], ids=["garbage", "header", "truncated"]
)
def test_a_damaged_store_is_one_line_for_every_command(big_run: Path, tmp_path: Path, damage):
    run = tmp_path / "run"
    run.mkdir()
    (run / DB_NAME).write_bytes((big_run / DB_NAME).read_bytes())
    game = open_reader(run).outcomes()[0].game
    damage(run / DB_NAME)
    before = (run / DB_NAME).read_bytes()
    commands = {
        "report": ["report", str(run)],
        "export": ["export", str(run)],
        "replay": ["replay", str(run), "--game", game],
        "view": ["view", str(run), "--port", "0"],
        "resume": ["run", "--resume", str(run)],
    }
    for name, args in commands.items():
        line = one_line_error(reflexsim(*args, timeout=120), "is damaged")
        assert "recover" in line and str(run / DB_NAME) in line, (name, line)
    assert (run / DB_NAME).read_bytes() == before  # nothing tried to write into it
    with pytest.raises(StoreDamagedError):  # a resume cannot open it for writing either
        RunStore(run)


def test_the_damage_message_says_what_still_reads(big_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / DB_NAME).write_bytes((big_run / DB_NAME).read_bytes())
    _garbage(run / DB_NAME)
    with pytest.raises(StoreDamagedError) as info:
        open_reader(run)
    message = str(info.value)
    assert "\n" not in message
    assert "what still reads" in message or "nothing in it reads" in message
    assert ".recover" in message


# -- a full disk ---------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs (root only; skipped where it cannot be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` but ``leave`` bytes with one file; returns it."""
    filler = disk / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    os.truncate(filler, max(0, filler.stat().st_size - (leave - free)))
    return filler


def test_a_full_disk_stops_the_run_in_one_line_and_resume_loses_nothing(
    generated_games: Path, tmp_path: Path, small_disk: Path
) -> None:
    args = ["--model", "scripted:learner", "--data", str(generated_games), "--split", SPLIT,
            "--games", "4", "--trials", "2", "--max-steps", "20", "--workers", "2",
            "--concurrency", "3"]  # fmt: skip
    reference = tmp_path / "reference"
    r = reflexsim("run", *args, "--run-dir", str(reference))
    assert r.returncode == 0, r.stderr[-3000:]
    total = steps_written(reference)

    run = small_disk / "run"
    filler = _fill(small_disk, leave=640 * 1024)  # the schema, the manifest, some steps
    r = reflexsim("run", *args, "--run-dir", str(run))
    line = one_line_error(r, "is full")
    assert "--resume" in line, line
    kept = steps_written(run)
    assert 0 < kept < total, (kept, total)  # it stopped part way, with what it had committed

    # still full: a resume, a report and an export (they write files there) say so in one line
    one_line_error(reflexsim("run", "--resume", str(run), *args), "is full")
    one_line_error(reflexsim("report", str(run)), "disk is full")
    one_line_error(reflexsim("export", str(run)), "disk is full")
    assert steps_written(run) == kept

    filler.unlink()  # space freed (and the report the full disk cut short)
    shutil.rmtree(run / "report", ignore_errors=True)
    r = reflexsim("run", "--resume", str(run), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    a, b = snapshot(reference), snapshot(run)
    assert b["rows"][0] == b["rows"][1]  # no step written twice
    assert a["episodes"] == b["episodes"]
    assert a["steps"] == b["steps"]
    assert a["reflections"] == b["reflections"]


def test_a_new_store_on_a_full_disk_leaves_no_trace(small_disk: Path) -> None:
    filler = _fill(small_disk, leave=0)
    with pytest.raises(StoreFullError, match="nothing was recorded"):
        RunStore(small_disk / "run", create=True)
    assert not list((small_disk / "run").iterdir())  # so a new run may start there again
    filler.unlink()
    RunStore(small_disk / "run", create=True).close()
