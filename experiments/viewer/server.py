"""The replay viewer's local HTTP server: the page, its two assets, and a read-only JSON API.

Every API request opens the run store read-only for just that request, so the viewer shows a run
that is still being written (SQLite's WAL lets readers run beside the writer). Only the routes
below exist; any other path, including traversal attempts, is a 404.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import sqlite3
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from experiments.errors import ConfigError, RunStoreError
from experiments.report import run_labels, summarize
from experiments.store import open_reader
from experiments.viewer.data import load_episode, prompt_view, run_index, step_prompt
from experiments.viewer.page import SERVED_CSP, asset, served_page

log = logging.getLogger("reflexsim.viewer")

_SECURITY_HEADERS = {
    "Content-Security-Policy": SERVED_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}
_STATIC = {
    "/static/viewer.js": ("viewer.js", "text/javascript; charset=utf-8"),
    "/static/viewer.css": ("viewer.css", "text/css; charset=utf-8"),
}


class _NotFound(Exception):
    pass


class _BadRequest(Exception):
    pass


class ViewerServer:
    """A running viewer: ``url`` to open, ``shutdown()`` to stop it."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread, run_dir: Path):
        self._httpd = httpd
        self._thread = thread
        self.run_dir = run_dir
        self.host, self.port = str(httpd.server_address[0]), int(httpd.server_address[1])
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/"

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ViewerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _Handler(BaseHTTPRequestHandler):
    server_version = "reflexsim-viewer"
    sys_version = ""
    run_dir: Path
    label: str
    allowed_hosts: frozenset[str] | None  # None: any Host header (bound to a public address)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("%s " + format, self.address_string(), *args)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        if (
            self.allowed_hosts is not None
            and self.headers.get("Host", "") not in self.allowed_hosts
        ):
            self._send_json({"error": "unexpected Host header"}, HTTPStatus.FORBIDDEN, head)
            return
        if not self.path.startswith("/"):
            self._send_json({"error": "not found"}, HTTPStatus.NOT_FOUND, head)
            return
        parts = urlsplit(self.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        try:
            if parts.path in ("/", "/index.html"):
                body = served_page(f"reflexsim replay: {self.label}").encode("utf-8")
                self._send(body, "text/html; charset=utf-8", HTTPStatus.OK, head)
            elif parts.path in _STATIC:
                name, ctype = _STATIC[parts.path]
                self._send(asset(name).encode("utf-8"), ctype, HTTPStatus.OK, head)
            elif parts.path == "/api/run":
                self._send_json(self._api_run(), HTTPStatus.OK, head)
            elif parts.path == "/api/episode":
                self._send_json(self._api_episode(_param(query, "id")), HTTPStatus.OK, head)
            elif parts.path == "/api/prompt":
                data = self._api_prompt(_param(query, "id"), _int_param(query, "step"))
                self._send_json(data, HTTPStatus.OK, head)
            else:
                raise _NotFound(parts.path)
        except _NotFound:
            self._send_json({"error": "not found"}, HTTPStatus.NOT_FOUND, head)
        except _BadRequest as exc:
            self._send_json({"error": str(exc)}, HTTPStatus.BAD_REQUEST, head)
        except sqlite3.Error as exc:  # e.g. the writer is mid-checkpoint: the page retries
            self._send_json(
                {"error": f"run store busy: {exc}"}, HTTPStatus.SERVICE_UNAVAILABLE, head
            )
        except RunStoreError as exc:  # it opened at start: it changed or is locked right now
            self._send_json({"error": str(exc)}, HTTPStatus.SERVICE_UNAVAILABLE, head)

    # -- API ---------------------------------------------------------------------------------
    def _api_run(self) -> dict[str, Any]:
        with open_reader(self.run_dir, check=False) as reader:  # checked at start
            return {
                "mode": "served",
                "runs": [run_index(reader, 0, self.label, summarize(reader))],
                "comparison": None,
                "plots": {},
            }

    def _api_episode(self, episode_id: str) -> dict[str, Any]:
        with open_reader(self.run_dir, check=False) as reader:  # checked at start
            detail = load_episode(reader, episode_id)
        if detail is None:
            raise _NotFound(episode_id)
        return detail

    def _api_prompt(self, episode_id: str, index: int) -> dict[str, Any]:
        with open_reader(self.run_dir, check=False) as reader:  # checked at start
            row = reader.episode(episode_id)
            if row is None:
                raise _NotFound(episode_id)
            steps = reader.steps(episode_id)
            try:
                prompt = step_prompt(reader, row, steps, index)
            except IndexError:
                raise _NotFound(f"{episode_id} step {index}") from None
        return {"episode": episode_id, **prompt_view(prompt)}

    # -- responses ---------------------------------------------------------------------------
    def _send_json(self, data: Any, status: HTTPStatus, head: bool) -> None:
        body = json.dumps(data, ensure_ascii=False).encode("utf-8")
        self._send(body, "application/json; charset=utf-8", status, head, cache=False)

    def _send(
        self, body: bytes, ctype: str, status: HTTPStatus, head: bool, cache: bool = False
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache" if cache else "no-store")
        for key, value in _SECURITY_HEADERS.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _param(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values or not values[0]:
        raise _BadRequest(f"missing query parameter {name!r}")
    return values[0]


def _int_param(query: dict[str, list[str]], name: str) -> int:
    value = _param(query, name)
    try:
        return int(value)
    except ValueError:
        raise _BadRequest(f"query parameter {name!r} must be an integer") from None


def _allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """On a loopback address, accept only loopback Host headers (stops DNS rebinding)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not loopback:
        return None
    return frozenset(f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]", host))


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> ViewerServer:
    """Serve the replay viewer of ``run_dir`` in a background thread (``port=0``: any free port)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port: use 1-65535 (0 = any free)")
    run_dir = Path(run_dir)
    open_reader(run_dir).close()  # a clear error now rather than on the first request
    handler: type[_Handler] = type(
        "ViewerHandler",
        (_Handler,),
        {"run_dir": run_dir, "label": run_labels([run_dir])[0], "allowed_hosts": None},
    )
    server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
    try:
        httpd = server_class((host, port), handler)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port (0 = any free)"
        ) from None
    httpd.daemon_threads = True
    handler.allowed_hosts = _allowed_hosts(host, int(httpd.server_address[1]))
    if handler.allowed_hosts is None:
        log.warning(
            "warning: the viewer listens on %s, reachable from the network: anyone who can reach"
            " port %d reads the run (prompts, model outputs), with no login. Serve on 127.0.0.1"
            " (the default) and use an SSH tunnel to view it from elsewhere",
            host,
            int(httpd.server_address[1]),
        )
    thread = threading.Thread(target=httpd.serve_forever, name="reflexsim-viewer", daemon=True)
    thread.start()
    return ViewerServer(httpd, thread, run_dir)
