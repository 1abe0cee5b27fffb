"""Text from outside (model output, a server's error, a game file, a config value) made safe to
print or log: control characters, terminal escape sequences among them, are shown escaped
(``\\x1b``), never passed through to a terminal or a log file. The replay, the CLI's error line
and every log handler of the project (the console, ``run.log``) use this one function; the
error line and the log handlers also leave secrets out (:func:`agents.llm.redaction.redact`)."""

from __future__ import annotations

import logging
import re

from agents.llm.redaction import redact

# Every C0/C1 control character except tab and newline (ESC, BEL, CR, DEL, CSI, ...), and the
# lone UTF-16 surrogates (JSON can carry one; no UTF-8 file or terminal takes it).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def escape_controls(text: str) -> str:
    """``text`` with each control character but tab and newline written as ``\\xNN``, and each
    lone surrogate as ``\\udNNN``."""
    return _CONTROL.sub(_escaped, text.replace("\r\n", "\n"))


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class EscapingFormatter(logging.Formatter):
    """A log formatter whose lines (message, traceback) carry no control characters and no
    secrets."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(redact(super().format(record)))


class QuietFileHandler(logging.FileHandler):
    """A log file that stops writing when it cannot (a full disk) instead of printing a
    traceback for every record: the run's own error says what happened."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - stdlib's name
        self.failed = True

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def close(self) -> None:
        try:
            super().close()  # the file is closed even when its last flush fails
        except OSError:
            self.failed = True  # what the full disk kept out of the log is lost, not the run
