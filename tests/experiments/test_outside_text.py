"""Secrets and text from outside: a key given on any surface (``--base-url``, a served model's
command and environment, backend and role options) is in no file a run writes and in no printed
line; a server's terminal escapes are shown escaped on stderr and in run.log; report.md shows
HTML from run values as text; the viewer warns when it listens beyond loopback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import pytest

from agents.llm.redaction import REDACTED, redact, secret_name
from experiments.config import RunConfig, public_values
from experiments.report import write_report
from experiments.serve import free_port
from experiments.store import open_reader
from experiments.terminal import escape_controls
from experiments.viewer import serve
from tests.experiments.test_runner import SPLIT, _look
from tests.experiments.test_serve import ROOT, stand_in
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


# -- a canary key through every surface a key can be given on ------------------------------------
CANARY = f"sk-canary-{uuid.uuid4().hex}"

# (id, the flags after the game selection, given the fault server's URL parts and tmp_path;
# whether a run store is made: the surface really was used)
Surface = tuple[str, Callable[[int, Path], list[str]], bool]


def _served(command: str, *more: str) -> Callable[[int, Path], list[str]]:
    def flags(port: int, tmp: Path) -> list[str]:
        template = f"{stand_in(tmp)} {command.format(key=CANARY)}"
        return ["--model", "vllm:fault-model", "--serve", "--serve-command", template,
                "--serve-port", str(free_port()), *more]  # fmt: skip

    return flags


def _openai(*flags: str) -> Callable[[int, Path], list[str]]:
    def made(port: int, tmp: Path) -> list[str]:
        given = [f.format(key=CANARY, port=port) for f in flags]
        if not any(f.startswith("--base-url") for f in flags):
            given += ["--base-url", f"http://127.0.0.1:{port}/v1"]
        return ["--model", "openai:test", "--backend-option", "max_retries=0", *given]

    return made


def _matrix(port: int, tmp: Path) -> list[str]:
    preset = tmp / "preset.yaml"
    preset.write_text("description: one job\njobs:\n  - {name: only, agent: react}\n")
    flags = _openai("--base-url=http://u:{key}@127.0.0.1:{port}/v1")(port, tmp)
    return ["--config", str(preset), *flags]


SURFACES: list[Surface] = [
    ("serve-command --api-key KEY", _served("--api-key {key}", "--verbose"), True),
    ("serve-command --api-key=KEY", _served("--api-key={key} --hf-token {key}"), True),
    ("serve-command --dry-run", _served("--api-key {key}", "--dry-run"), False),
    ("base-url without a scheme", _openai("--base-url=u:{key}@127.0.0.1:{port}/v1"), False),
    ("base-url with a space", _openai("--base-url=http://u:{key} @127.0.0.1:{port}/v1"), False),
    ("base-url in a query", _openai("--base-url=http://127.0.0.1:{port}/v1?token={key}"), True),
    (
        "extra_body api_key",
        _openai('--backend-option=extra_body={{"api_key": "{key}"}}', "--verbose"),
        True,
    ),  # fmt: skip
    ("backend-option x-api-key", _openai("--backend-option=x-api-key={key}"), False),
    (
        "role-option reflect.api_key --dry-run",
        _openai("--role-option=reflect.api_key={key}", "--dry-run"),
        False,
    ),  # fmt: skip
    (
        "role-option reflect.api-key --dry-run",
        _openai("--role-option=reflect.api-key={key}", "--dry-run"),
        False,
    ),  # fmt: skip
    (
        "role-option reflect.api_key",
        _openai("--reflect-model=openai:test", "--role-option=reflect.api_key={key}"),
        False,
    ),  # fmt: skip
    ("a preset's state file", _matrix, True),
]


@pytest.mark.parametrize(
    ("flags", "plays"), [s[1:] for s in SURFACES], ids=[s[0] for s in SURFACES]
)
def test_a_canary_key_reaches_no_file_and_no_printed_line(
    generated_games: Path, tmp_path: Path, flags: Callable[[int, Path], list[str]], plays: bool
) -> None:
    """The key is in no file under the folder the run wrote (the SQLite store read as bytes, the
    server's log and pid file, config.yaml, run.log, a preset's matrix.json) and in no line the
    command printed, whether the run played, printed a plan or was refused."""
    run = tmp_path / "run"
    # every case: a served model's key in its environment too (a pid file records the server's)
    env = {**os.environ, "VLLM_API_KEY": CANARY}
    env.pop("OPENAI_API_KEY", None)
    with FaultServer(answer=_look) as server:
        args = [
            "run", "--data", str(generated_games), "--split", SPLIT, "--games", "1",
            "--trials", "1", "--max-steps", "2", "--run-dir", str(run),
            *flags(server.port, tmp_path),
        ]  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "experiments.cli", *args],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
        )  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode in (0, 2, 3), r.stderr[-3000:]
    for where, text in (("stdout", r.stdout), ("stderr", r.stderr)):
        for line in text.splitlines():
            assert CANARY[10:26] not in line, (where, line)
    stores = list(run.rglob("run.sqlite"))
    assert bool(stores) == plays, (r.returncode, r.stderr[-3000:])
    for path in (p for p in run.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert CANARY[10:26].encode() not in data, f"key leaked into {path}"


def test_redact_covers_every_form_of_a_key() -> None:
    key = CANARY
    texts = {
        f"http://user:{key}@h:8000/v1": "http://h:8000/v1",
        f"http://u:{key}@h1/v1?api_key={key}#{key},https://h2/v1?t={key}": "http://h1/v1,https://h2/v1",
        f"user:{key}@h:8000/v1": "h:8000/v1",
        f"h:8000/v1?api_key={key}&n=1": f"h:8000/v1?api_key={REDACTED}&n=1",
        f"http://user:{key} @h/v1": f"http://{REDACTED} @h/v1",
        f"vllm serve m --api-key {key} --port 8": f"vllm serve m --api-key {REDACTED} --port 8",
        f"vllm serve m --port --token={key}": f"vllm serve m --port --token={REDACTED}",
        f'extra_body={{"api_key": "{key}"}}': f'extra_body={{"api_key": {REDACTED}}}',
        f"-H 'Authorization: Bearer {key}'": f"-H 'Authorization: {REDACTED}'",
        # a server printing its arguments: a list (argv), a dict (vLLM's non-default args)
        f"args: ['8', '--api-key', '{key}', '--port']": f"args: ['8', '--api-key', {REDACTED}, '--port']",
        f"{{'api_key': ['{key}'], 'port': 8}}": f"{{'api_key': {REDACTED}, 'port': 8}}",
    }  # fmt: skip
    for text, expected in texts.items():
        assert redact(text) == expected, text
    for kept in ("max_tokens: 7, model: openai:x", "/runs/exp@v2/run", "{python} s.py {port}",
                 "api_key, max_tokens", "['--api-key', '--port', '8']"):  # fmt: skip
        assert redact(kept) == kept
    assert redact(["serve", "--api-key", key, "--port", "8", "--password", "--x"]) == [
        "serve", "--api-key", REDACTED, "--port", "8", "--password", "--x",
    ]  # fmt: skip
    nested = {"extra_body": {"apiKey": key, "top_k": 3}, "role": {"reflect.client-secret": key}}
    assert redact(nested) == {"extra_body": {"top_k": 3}, "role": {}}
    assert [n for n in ("api_key", "HF_TOKEN", "x-api-key", "apiKey", "Authorization",
                        "max_tokens", "api_key_env", "tokenizer", "author")
            if secret_name(n)] == ["api_key", "HF_TOKEN", "x-api-key", "apiKey", "Authorization"]  # fmt: skip


def test_a_command_recorded_without_its_key_is_given_again_on_resume() -> None:
    """A resume reads the recorded config: a served command recorded with ``<redacted>`` in it
    is refused in one line naming the flag until the command is given again."""
    from experiments.cli import build_parser
    from experiments.config import resolve
    from experiments.errors import ConfigError

    command = f"vllm serve {{model}} --port {{port}} --api-key {KEY}"
    recorded = RunConfig.of(model="vllm:m", serve=True, serve_command=command).to_dict(public=True)
    assert KEY not in repr(recorded)
    assert recorded["serve_command"] == f"vllm serve {{model}} --port {{port}} --api-key {REDACTED}"
    parse = build_parser().parse_args
    with pytest.raises(ConfigError, match="pass --serve-command .* again"):
        resolve(parse(["run", "--resume", "r"]), recorded)
    cfg = resolve(parse(["run", "--resume", "r", "--serve-command", command]), recorded)
    assert cfg.server.serve_command == command


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
