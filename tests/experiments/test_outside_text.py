"""Secrets and text from outside: a key in ``--base-url`` is in no file a run writes and in no
printed line; a server's terminal escapes are shown escaped on stderr and in run.log; report.md
shows HTML from run values as text; the viewer warns when it listens beyond loopback."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import pytest

from experiments.config import RunConfig, public_values
from experiments.report import write_report
from experiments.store import open_reader
from experiments.terminal import escape_controls
from experiments.viewer import serve
from tests.experiments.test_runner import SPLIT, _look
from tests.experiments.test_store_faults import reflexsim
from tests.support.fault_server import FaultServer
from tests.support.runfactory import make_run, standard_tasks

KEY = "sk-live-0123456789abcdefSECRET"
ESCAPES = "\x1b]0;pwned\x07\x1b[2J"


def _files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.is_file()]


@pytest.mark.parametrize(
    "url", ["http://user:{key}@127.0.0.1:{port}/v1", "http://127.0.0.1:{port}/v1?api_key={key}"],
    ids=["userinfo", "query"],
)  # fmt: skip
def test_a_key_in_the_base_url_is_written_and_printed_nowhere(
    generated_games: Path, tmp_path: Path, url: str
) -> None:
    run = tmp_path / "run"
    with FaultServer(answer=_look) as server:
        base_url = url.format(key=KEY, port=server.port)
        r = reflexsim(
            "run", "--model", "openai:test", "--base-url", base_url, "--data",
            str(generated_games), "--split", SPLIT, "--games", "2", "--trials", "2",
            "--max-steps", "4", "--run-dir", str(run), "--verbose",
            "--backend-option", "max_retries=0",
        )  # fmt: skip
    # the SDK joins its paths after a query (``/v1/?api_key=…completions``), so that server
    # answers 404 and every episode ends as an infrastructure error: exit 3, and still no key
    assert r.returncode == (3 if "?" in url else 0), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert '"base_url": "http://127.0.0.1:' in r.stderr  # --verbose printed the config
    assert KEY not in r.stdout and KEY not in r.stderr
    files = _files(run)
    names = {p.name for p in files}
    assert {"run.sqlite", "config.yaml", "run.log", "report.md"} <= names, names
    for path in files:  # the store (binary, WAL checkpointed at close), config, log, report
        assert KEY.encode() not in path.read_bytes(), path
        assert KEY[4:20].encode() not in path.read_bytes(), path  # nor a piece of it
    with open_reader(run) as reader:
        manifest = reader.get_meta("manifest")
    assert manifest["config"]["base_url"] == f"http://127.0.0.1:{server.port}/v1"


def test_the_public_config_copy_has_no_secrets() -> None:
    cfg = RunConfig.of(
        model="openai:test",
        base_url=f"http://u:{KEY}@h1:8000/v1?api_key={KEY}#{KEY},https://h2/v1?token={KEY}",
        backend_options={"api_key": KEY, "access_token": KEY, "max_tokens": 7, "timeout": 3},
    )
    public = cfg.to_dict(public=True)
    assert public["base_url"] == "http://h1:8000/v1,https://h2/v1"
    assert public["backend_options"] == {"max_tokens": 7, "timeout": 3}
    assert KEY not in repr(cfg.to_tree(public=True))
    assert cfg.to_dict()["base_url"].count(KEY) == 4  # the run itself still has it
    # a matrix's state file: its flags and the preset's base and jobs
    preset = {"base": {"base_url": f"http://u:{KEY}@h/v1"}, "jobs": [{"api_key": KEY}]}
    assert KEY not in repr(public_values({"preset": preset, "flags": {"base_url": f"h://{KEY}@x"}}))


class _Hostile(BaseHTTPRequestHandler):
    """Answers every request with an error (``status``) whose message holds terminal escapes
    (the client shows it as it is)."""

    status = 500

    def do_POST(self) -> None:  # noqa: N802 - stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        message = f"upstream exploded {ESCAPES} done"
        body = json.dumps({"error": {"message": message, "type": "server_error"}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass


@pytest.mark.parametrize("status", [500, 400])
def test_a_servers_terminal_escapes_are_escaped_on_stderr_and_in_run_log(
    generated_games: Path, tmp_path: Path, status: int
) -> None:
    handler = type("Hostile", (_Hostile,), {"status": status})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    Thread(target=httpd.serve_forever, daemon=True).start()
    run = tmp_path / "run"
    try:
        r = reflexsim(
            "run", "--model", "openai:test", "--base-url",
            f"http://127.0.0.1:{httpd.server_address[1]}/v1", "--data", str(generated_games),
            "--split", SPLIT, "--games", "1", "--trials", "1", "--run-dir", str(run),
            "--backend-option", "max_retries=0",
        )  # fmt: skip
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    log = (run / "run.log").read_text()
    for where, text in (("stderr", r.stderr), ("run.log", log)):
        assert "\x1b" not in text and "\x07" not in text, where  # never the server's escapes
        if status < 500:  # a refused request's text is shown (a 5xx is retried: its status)
            assert escape_controls(ESCAPES) in text, (where, text[-2000:])
    assert escape_controls(ESCAPES) == "\\x1b]0;pwned\\x07\\x1b[2J"


def test_escape_controls_keeps_lines_and_tabs() -> None:
    assert escape_controls("a\tb\nc\r\nd\re\x00\x9b") == "a\tb\nc\nd\\x0de\\x00\\x9b"


def test_report_md_shows_html_from_run_values_as_text(tmp_path: Path) -> None:
    model = 'scripted:<img src=x onerror="alert(1)">'
    run = make_run(tmp_path / "run", standard_tasks(), model=model, arm="reflexion")
    md = (write_report([run]) / "report.md").read_text()
    assert "<img" not in md
    assert "&lt;img src=x onerror=" in md


def test_the_viewer_warns_when_it_listens_beyond_loopback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path / "run", standard_tasks())
    with caplog.at_level(logging.WARNING, logger="reflexsim.viewer"):
        server = serve(run, host="127.0.0.1", port=0)
        server.shutdown()
        assert not caplog.records  # loopback: nothing to say
        server = serve(run, host="0.0.0.0", port=0)
        server.shutdown()
    (warning,) = caplog.records
    assert "reachable from the network" in warning.getMessage()
    assert "0.0.0.0" in warning.getMessage()


def test_the_cli_error_line_escapes_outside_text(tmp_path: Path) -> None:
    bad = tmp_path / f"run{ESCAPES}"
    r = reflexsim("report", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr
    assert "pwned" in r.stderr
