"""Files a user keeps are written whole or not at all (``memory.files.atomic_write``): an
export killed with ``kill -9`` mid-write leaves the previous file as it was and no temporary;
an error, Ctrl-C included, leaves none either; a report and a config copy leave none."""

from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memory import files
from memory.files import atomic_write, write_text
from tests.support.runfactory import make_run, many_tasks

ROOT = Path(__file__).resolve().parent.parent.parent
HANG_GUARD_S = 120.0
# format -> the files an export to a folder writes, in the order it writes them
WRITES = {
    "jsonl": ["episodes.jsonl", "steps.jsonl"],
    "csv": ["episodes.csv", "steps.csv"],
    "sft": ["sft.jsonl"],
    "preference": ["preference.jsonl"],
}


@pytest.fixture(scope="module")
def many_episodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run whose every export is some hundred kilobytes (many write calls)."""
    return make_run(tmp_path_factory.mktemp("stores") / "run", many_tasks(12))


def _export(run: Path, fmt: str, out: Path, *runner: str) -> list[str]:
    """The command line of ``reflexsim export`` (``runner``: the module that runs it, and its
    own arguments)."""
    args = ["export", str(run), "--format", fmt, "--out", str(out), "--force"]
    return [sys.executable, "-m", *(runner or ["experiments.cli"]), *args]


def _reflexsim(command: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, **kw
    )


def _previous(out: Path, fmt: str) -> dict[str, bytes]:
    """Files of an earlier export in ``out`` (content an export of the run never writes)."""
    out.mkdir(parents=True, exist_ok=True)
    before = {name: f"an earlier export's {name}\n".encode() for name in WRITES[fmt]}
    for name, data in before.items():
        (out / name).write_bytes(data)
    return before


def _unnamed_files_work(folder: Path) -> bool:
    """Whether ``folder``'s file system makes unnamed files (``O_TMPFILE``)."""
    try:
        os.close(os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except (AttributeError, OSError):
        return False
    return True


def _process_state(pid: int) -> str:
    """The one-letter state /proc gives a process (``T``: stopped)."""
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return stat_line.rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("fmt", sorted(WRITES))
def test_kill_9_mid_export_keeps_the_previous_file_and_leaves_no_temporary(
    many_episodes: Path, tmp_path: Path, fmt: str
) -> None:
    out = tmp_path / "out"
    before = _previous(out, fmt)
    command = _export(many_episodes, fmt, out, "tests.support.stop_mid_write", str(out))
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while _process_state(proc.pid) != "T":  # stopped with bytes written, more to come
            assert proc.poll() is None, f"the export ended unstopped: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "the export never began writing"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert {name: (out / name).read_bytes() for name in before} == before
    if not _unnamed_files_work(out):
        pytest.skip("no O_TMPFILE on this file system: a kill -9 leaves the named temporary")
    assert sorted(os.listdir(out)) == sorted(before)  # no temporary, nothing else

    # the same export run to its end replaces them, and leaves nothing else either
    r = _reflexsim(_export(many_episodes, fmt, out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(before)
    for name in before:
        assert (out / name).read_bytes() != before[name]
        assert (out / name).stat().st_size > 50_000, "too small to be stopped mid-way"


def _limit_file_size(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("fmt", ["csv", "sft"])
def test_an_export_that_cannot_finish_is_one_line_and_leaves_no_temporary(
    many_episodes: Path, tmp_path: Path, fmt: str
) -> None:
    """A write that fails part way (here: the file size limit, EFBIG) is a handled error."""
    out = tmp_path / "out"
    before = _previous(out, fmt)
    r = _reflexsim(_export(many_episodes, fmt, out), preexec_fn=lambda: _limit_file_size(2**16))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(out)) == sorted(before)
    assert {name: (out / name).read_bytes() for name in before} == before


def test_a_report_and_a_config_copy_leave_no_temporary(many_episodes: Path, tmp_path: Path) -> None:
    from experiments.cli import main

    out = tmp_path / "report"
    assert main(["report", str(many_episodes), "--out", str(out)]) == 0
    assert main(["report", str(many_episodes), "--out", str(out)]) == 0  # replaced in place
    names = os.listdir(out)
    assert {"summary.json", "learning_curve.png", "report.md", "index.html"} <= set(names)
    assert not [n for n in names if n.startswith(".")], names
    assert (out / "learning_curve.png").read_bytes().startswith(b"\x89PNG")


# -- the helper ----------------------------------------------------------------------------------
@pytest.fixture(params=["unnamed", "named"])
def temporaries(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a temporary is made: unnamed (O_TMPFILE), and named where that is missing."""
    if request.param == "named":
        monkeypatch.setattr(files, "_PROC_FD", Path("/no/such/proc/fd"))
    elif not (hasattr(os, "O_TMPFILE") and files._PROC_FD.is_dir()):
        pytest.skip("no O_TMPFILE here")
    return str(request.param)


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_an_error_inside_leaves_the_file_as_it_was(
    tmp_path: Path, temporaries: str, error: type[BaseException]
) -> None:
    target = tmp_path / "kept.txt"
    target.write_text("before\n")
    with pytest.raises(error), atomic_write(target) as f:
        f.write("x" * 100_000)
        f.flush()
        raise error("stopped mid-write")
    assert target.read_text() == "before\n"
    assert os.listdir(tmp_path) == ["kept.txt"]


def test_a_written_file_is_whole_and_made_as_the_user_makes_files(
    tmp_path: Path, temporaries: str
) -> None:
    umask = os.umask(0o027)
    try:
        write_text(tmp_path / "a.txt", "one\n")
        with atomic_write(tmp_path / "b.bin", "wb") as f:
            f.write(b"\x00\x01")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.txt").read_text() == "one\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin"]
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640  # 0o666 less the umask
    with pytest.raises(ValueError, match="whole file"):
        atomic_write(tmp_path / "c.txt", "a").__enter__()
