"""The replay viewer's server (loopback, only the run's data, live runs), the static page, replay."""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agents.prompting import actor_prompt
from experiments.errors import ConfigError, RunStoreError
from experiments.replay import replay
from experiments.report import write_report
from experiments.store import DB_NAME, RunStore, episode_id, open_reader
from experiments.viewer import serve
from experiments.viewer.data import load_episode, run_index, step_prompt
from experiments.viewer.page import json_for_script
from memory.records import Step
from tests.support.runfactory import PAYLOAD, episode_steps, game_id, make_run, standard_tasks, task

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "run", standard_tasks())


@pytest.fixture(scope="module")
def server(run_dir: Path):
    srv = serve(run_dir)
    yield srv
    srv.shutdown()


def get(srv, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """A raw GET: the path goes on the wire exactly as given (no client-side normalising)."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get_json(srv, path: str):
    status, _, body = get(srv, path)
    assert status == 200, (path, status, body[:200])
    return json.loads(body)


def q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def test_binds_to_loopback_by_default(server) -> None:
    assert server.host == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}/"
    status, headers, body = get(server, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert headers["x-content-type-options"] == "nosniff"
    assert b'<script src="/static/viewer.js">' in body
    # Not reachable on the machine's other addresses.
    other = socket.gethostbyname(socket.gethostname())
    if not other.startswith("127."):
        with pytest.raises(OSError), socket.create_connection((other, server.port), timeout=2):
            pass


@pytest.mark.parametrize(
    "path",
    [
        "/../../etc/passwd",
        "/static/../../run.sqlite",
        "/static/..%2f..%2frun.sqlite",
        "/static/%2e%2e/%2e%2e/run.sqlite",
        "/run.sqlite",
        "/static/run.sqlite",
        "/static/",
        "/static/viewer.js/../../../run.sqlite",
        "//etc/passwd",
        "/api/../run.sqlite",
        "/static/../viewer/server.py",
        "http://127.0.0.1/../../etc/passwd",
    ],
)
def test_serves_only_the_runs_data(server, path: str) -> None:
    status, _, body = get(server, path, host=f"127.0.0.1:{server.port}")
    assert status == 404
    assert b"SQLite format" not in body and b"root:" not in body


def test_assets_and_dns_rebinding(server) -> None:
    status, headers, body = get(server, "/static/viewer.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    # all data goes through textContent: no HTML-parsing sinks in the page's code
    assert not re.search(
        rb"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|eval\(", body
    )
    status, _, _ = get(server, "/api/run", host=f"attacker.example:{server.port}")
    assert status == 403


def test_api_episode_and_the_exact_prompt(server, run_dir: Path) -> None:
    game = game_id("clean", 2)
    index = get_json(server, "/api/run")
    run = index["runs"][0]
    assert run["arm"] == "reflexion" and len(run["episodes"]) == 9
    assert run["summary"]["trials"][-1]["cumulative_solved"] == 3

    detail = get_json(server, "/api/episode?id=" + q(episode_id(game, 1)))
    assert detail["won"] and detail["trial"] == 1 and len(detail["steps"]) == 5
    assert [m["trial"] for m in detail["memory"]] == [0] and PAYLOAD in detail["memory"][0]["text"]
    assert detail["steps"][0]["raw_output"] == f" think: {PAYLOAD}"

    store = RunStore(run_dir, readonly=True)
    row = store.episode(episode_id(game, 1))
    steps = store.steps(row.episode_id)
    store.close()
    for i in range(len(steps)):
        answer = get_json(server, f"/api/prompt?id={q(row.episode_id)}&step={i}")
        got = answer["prompt"]
        history = [(s.action or s.raw_output.strip(), s.observation) for s in steps[:i]]
        assert got == actor_prompt(row.prompt_prefix, row.observation, history)
        assert answer["source"] == "rebuilt"  # this store recorded no request: it says so
    assert "Your memory for the task below" in got and got.endswith("\n>")

    assert get(server, "/api/episode?id=nope")[0] == 404
    assert get(server, f"/api/prompt?id={q(row.episode_id)}&step=99")[0] == 404
    assert get(server, f"/api/prompt?id={q(row.episode_id)}&step=x")[0] == 400
    assert get(server, "/api/episode")[0] == 400


def test_step_prompt_is_what_the_actor_sent(run_dir: Path) -> None:
    from agents.evaluators import make_evaluator
    from agents.llm.base import GenerationConfig
    from agents.parsing import GroundingRules
    from agents.react import ActorSettings, actor_request
    from memory.records import EnvReply

    settings = ActorSettings(GenerationConfig(), make_evaluator("paper"), GroundingRules(), 30)
    store = RunStore(run_dir, readonly=True)
    try:
        for row in store.episodes():
            steps = store.steps(row.episode_id)
            for i in range(len(steps)):
                sent = actor_request(
                    settings, row.prompt_prefix, row.observation, steps[:i], EnvReply(""),
                    game=row.game, trial=row.trial, seed=0,
                )  # fmt: skip
                assert step_prompt(store, row, steps, i).shown == sent.prompt
    finally:
        store.close()


def test_works_on_a_run_that_is_still_being_written(tmp_path: Path) -> None:
    game = game_id("cool", 7)
    run = make_run(
        tmp_path / "live", [task("cool", 7, "running")], trials=1, wall_s=None, complete=False
    )
    eid = episode_id(game, 0)
    writer = RunStore(run)  # the runner's connection stays open while the viewer reads
    with serve(run) as srv:
        first = get_json(srv, "/api/episode?id=" + q(eid))
        assert first["status"] == "running" and len(first["steps"]) == 4
        extra = episode_steps("won")[4]
        writer.add_step(eid, extra)
        writer.add_step(
            eid, Step(index=5, kind="act", raw_output="look", action="look", observation="Done.")
        )
        second = get_json(srv, "/api/episode?id=" + q(eid))
        assert len(second["steps"]) == 6 and second["steps"][5]["observation"] == "Done."
        assert get_json(srv, "/api/run")["runs"][0]["episodes"][0]["steps"] == 6
        writer.finish_episode(eid, status="done", won=True)
        writer.end_task(game, 0, "solved")
        index = get_json(srv, "/api/run")
        assert index["runs"][0]["episodes"][0]["won"] and index["runs"][0]["status"]["complete"]
        assert index["runs"][0]["summary"]["solved"] == 1
    writer.close()


def test_a_store_from_before_the_experience_record_still_reads(tmp_path: Path) -> None:
    """A store without the episodes' experience column (made before it) opens read-only
    untouched, its episodes record no experience and the viewer's data loads; a writer adds the
    column, and an episode written then records what it was shown."""
    run = make_run(tmp_path / "old", [task("cool", 7, "won")], trials=1)
    conn = sqlite3.connect(run / DB_NAME, isolation_level=None)
    try:
        conn.execute("ALTER TABLE episodes DROP COLUMN experience_json")
    finally:
        conn.close()
    before = hashlib.sha256((run / DB_NAME).read_bytes()).hexdigest()
    eid = episode_id(game_id("cool", 7), 0)
    with open_reader(run) as reader:
        assert [e.experience_json for e in reader.episodes()] == [None]
        assert run_index(reader, 0, "old", None)["experience"] is None
        detail = load_episode(reader, eid)
    assert detail is not None and detail["experience"] is None and len(detail["steps"]) == 5
    assert hashlib.sha256((run / DB_NAME).read_bytes()).hexdigest() == before

    shown = {"rules": [{"task_type": "cool", "text": "use the fridge", "votes": 2}]}
    writer = RunStore(run)
    try:
        writer.start_episode(
            episode_id="new", game="g", task_type="cool", trial=0, arm="insights",
            prompt_prefix="", observation="", task="", memory=(), experience=shown,
        )  # fmt: skip
    finally:
        writer.close()
    with open_reader(run) as reader:
        assert reader.episode(eid).experience_json is None
        detail = load_episode(reader, "new")
    assert detail is not None and detail["experience"] == {**shown, "retrieved": []}


def test_serve_errors_are_one_line(tmp_path: Path, run_dir: Path) -> None:
    with pytest.raises(RunStoreError, match="not a run directory"):
        serve(tmp_path)
    with serve(run_dir) as srv, pytest.raises(ConfigError, match="--port"):
        serve(run_dir, port=srv.port)


def test_static_page_embeds_the_data_safely(run_dir: Path, tmp_path: Path) -> None:
    out = write_report([run_dir], tmp_path / "report")
    html = (out / "index.html").read_text()
    assert PAYLOAD not in html and "window.__pwned" in html  # present, but only escaped
    m = re.search(r'<script type="application/json" id="reflexsim-data">(.*?)</script>', html, re.S)
    assert m and "<" not in m.group(1)
    data = json.loads(m.group(1))
    assert data["mode"] == "static" and len(data["details"]["0"]) == 9
    detail = data["details"]["0"][episode_id(game_id("clean", 2), 0)]
    assert detail["steps"][0]["raw_output"] == f" think: {PAYLOAD}"
    assert data["plots"]["learning_curve"].startswith("data:image/png;base64,")
    # A hash-based CSP that allows exactly the inline script and style, nothing else.
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    assert len(scripts) == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp.replace("&#x27;", "'")
    assert "unsafe" not in csp and "default-src 'none'" in csp.replace("&#x27;", "'")


def test_json_for_script_escapes_html_breakers() -> None:
    text = json_for_script({"a": "</script><!-- & \u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><!-- & \u2028"}


# -- terminal replay ---------------------------------------------------------------------------
def test_replay_prints_the_episode_as_plain_text(run_dir: Path) -> None:
    out = io.StringIO()
    replay(run_dir, game_id("clean", 2), 0, out)
    text = out.getvalue()
    assert "\x1b" not in text
    assert "FAILED" in text and "failure class: repeated_action" in text
    assert f"> think: {PAYLOAD}" in text
    assert "> take banana 9 from countertop 1  [not admissible]" in text
    assert "(invalid output)" in text and "You arrive at countertop 1." in text
    assert "reflection written after this trial" in text
    won = io.StringIO()
    replay(run_dir, game_id("clean", 2), 1, won)
    assert "WON" in won.getvalue() and "reflections in the prompt" in won.getvalue()
    asked = io.StringIO()
    replay(run_dir, game_id("clean", 2), 1, asked, prompts=True)
    assert "[0] prompt, rebuilt from the steps (not recorded):" in asked.getvalue()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_replay_colours_a_tty_and_never_passes_model_escapes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    run = make_run(tmp_path / "esc", [task("put", 1, "won")], trials=1)
    writer = RunStore(run)
    eid = episode_id(game_id("put", 1), 0)
    writer.add_step(
        eid, Step(index=9, kind="act", raw_output="x", action="look\x1b[2J", observation="ok")
    )
    writer.close()
    tty = _Tty()
    replay(run, game_id("put", 1), 0, tty)
    assert "\x1b[32mWON\x1b[0m" in tty.getvalue()
    assert "\x1b[2J" not in tty.getvalue() and "look\\x1b[2J" in tty.getvalue()


def test_replay_unknown_game_or_trial(run_dir: Path) -> None:
    with pytest.raises(RunStoreError, match="did you mean"):
        replay(run_dir, game_id("clean", 2)[:-3], 0, io.StringIO())
    with pytest.raises(RunStoreError, match=r"no trial 5.*\[0, 1\]"):
        replay(run_dir, game_id("clean", 2), 5, io.StringIO())


# -- through the CLI ---------------------------------------------------------------------------
def _cli(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "experiments.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, **kw,
    )  # fmt: skip


def test_cli_replay_and_report(run_dir: Path, tmp_path: Path) -> None:
    r = _cli("replay", str(run_dir), "--game", game_id("heat", 3), "--trial", "0")
    assert r.returncode == 0, r.stderr
    assert "ERROR (harness)" in r.stdout and "backend: connection refused" in r.stdout
    assert "\x1b" not in r.stdout
    r = _cli("replay", str(run_dir), "--game", "nope", "--trial", "0")
    assert r.returncode == 2 and r.stderr.startswith("reflexsim: error: no game 'nope'")
    assert "Traceback" not in r.stderr
    r = _cli("report", str(run_dir), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "rep") and (tmp_path / "rep" / "index.html").is_file()


def test_cli_view_serves_on_loopback(run_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "view", str(run_dir), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:(\d+)/)", line)
        assert m, line + proc.stderr.read()
        with urllib.request.urlopen(m.group(1) + "api/run", timeout=10) as resp:
            assert json.loads(resp.read())["runs"][0]["arm"] == "reflexion"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
