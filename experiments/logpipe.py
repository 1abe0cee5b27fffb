"""A model server's output into its log through the redaction pass: ``main([LOG, "--",
*COMMAND])`` runs the command with its stdout and stderr appended to ``LOG`` line by line through
:func:`agents.llm.redaction.redact`, so that what a server prints of its own arguments (``vllm
serve`` logs every non-default one, ``--api-key`` included) reaches its log without the key.

:data:`experiments.serve.LOG_PIPE` starts it as a process of its own, the server's parent in the
server's process group (one signal stops both). It ignores SIGINT and SIGTERM so that it writes
the server's last lines, ends when the server's output does, and exits as the server did (its
code, or the signal that ended it).
"""

from __future__ import annotations

import os
import signal
import subprocess

from agents.llm.redaction import redact


def main(argv: list[str]) -> int:
    """Run ``argv[2:]`` with its output into the log ``argv[0]`` (``argv[1]`` is ``--``);
    returns its exit code."""
    if len(argv) < 3 or argv[1] != "--":
        raise ValueError("logpipe takes LOG -- COMMAND...")
    log_path, command = argv[0], argv[2:]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the server gets it too; its output is still read
    with open(log_path, "ab", buffering=0) as log:
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                restore_signals=True,
                preexec_fn=_default_signals,  # noqa: PLW1509 - no threads in this process
            )
        except OSError as exc:
            log.write(f"cannot start {command[0]!r}: {exc.strerror or exc}\n".encode())
            return 127
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(redact(line.decode(errors="replace")).encode())
    code = proc.wait()
    if code < 0:  # ended by a signal: end by the same one, so that the supervisor reads it so
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
