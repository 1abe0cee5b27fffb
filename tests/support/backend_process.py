"""A backend run by scripts/backend_stdio.py in another python (e.g. .venv-vllm, which holds
vLLM's CPU build and torch), driven from the test's own environment one batch at a time."""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agents.llm.base import Completion, Request

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "backend_stdio.py"


def offline_env() -> dict[str, str]:
    """This environment, offline for model hubs, with the repository importable."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class BackendProcess:
    """``send(op, requests)``: ``generate``, ``concurrent`` or ``sequential`` (see the script)."""

    def __init__(self, python: str, spec: str, options: Mapping[str, Any], log: Path) -> None:
        self.log = log
        argv = [python, str(SCRIPT), spec]
        for name, value in options.items():
            argv += ["--option", f"{name}={value}"]
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=offline_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log.open("w"), text=True,
        )  # fmt: skip
        self.ready = self._read(300)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            pytest.fail(f"backend_stdio gave no answer: {self.log.read_text()[-3000:]}")
        message: dict[str, Any] = json.loads(line)
        return message

    def ask(self, op: str, requests: list[Request]) -> dict[str, Any]:
        """The other process's answer to one batch, as it is (completions or an error)."""
        assert self.proc.stdin is not None
        payload = [r.to_json() for r in requests]
        self.proc.stdin.write(json.dumps({"op": op, "requests": payload}) + "\n")
        self.proc.stdin.flush()
        return self._read(900)

    def send(self, op: str, requests: list[Request]) -> tuple[list[Completion], float]:
        """The completions and the wall time of the whole batch, as the other process saw it."""
        answer = self.ask(op, requests)
        assert "error" not in answer, answer["error"]
        return [Completion(**c) for c in answer["completions"]], float(answer["wall_s"])

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the script closes its backend and exits
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def converted_checkpoint(python: str) -> str:
    """The embedded Gemma GGUF as a Hugging Face checkpoint (converted once, then cached)."""
    convert = subprocess.run(
        [python, str(REPO / "scripts" / "convert_embedded_to_hf.py")],
        cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert convert.returncode == 0, convert.stderr[-3000:]
    return convert.stdout.strip().splitlines()[-1]
