"""The replay page's HTML: one shell for the served viewer and the self-contained static report.

The page's script builds all content with ``textContent``; run data reaches it only as JSON
(fetched, or embedded in a non-executed ``application/json`` script with ``<`` escaped).
"""

from __future__ import annotations

import base64
import hashlib
import json
from functools import cache
from html import escape
from importlib import resources
from typing import Any

ASSETS = ("viewer.js", "viewer.css")

# The served page loads its script and style from /static and talks only to its own origin.
SERVED_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_SHELL = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
{csp}<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<link rel="icon" href="data:,">
<title>{title}</title>
{style}
</head>
<body>
{data}<div id="app" data-mode="{mode}"><p class="loading">Loading…</p></div>
{script}
</body>
</html>
"""


@cache
def asset(name: str) -> str:
    """A file of the page (``viewer.js``, ``viewer.css``), shipped as package data."""
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files("experiments.viewer").joinpath(name).read_text(encoding="utf-8")


def json_for_script(data: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' survive unescaped."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _sha256_source(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def served_page(title: str) -> str:
    return _SHELL.format(
        csp="",
        title=escape(title),
        style='<link rel="stylesheet" href="/static/viewer.css">',
        data="",
        mode="served",
        script='<script src="/static/viewer.js"></script>',
    )


def static_page(title: str, data: Any) -> str:
    """A page that works from file:// with everything inline, under a hash-based CSP."""
    js, css = asset("viewer.js"), asset("viewer.css")
    for name, text, end in (("viewer.js", js, "</script"), ("viewer.css", css, "</style")):
        if end in text.lower():
            raise ValueError(f"{name} must not contain {end!r}: it is inlined")
    csp = (
        f"default-src 'none'; script-src {_sha256_source(js)}; style-src {_sha256_source(css)};"
        " img-src data:; base-uri 'none'; form-action 'none'"
    )
    return _SHELL.format(
        csp=f'<meta http-equiv="Content-Security-Policy" content="{escape(csp)}">\n',
        title=escape(title),
        style=f"<style>{css}</style>",
        data=(
            '<script type="application/json" id="reflexsim-data">'
            + json_for_script(data)
            + "</script>\n"
        ),
        mode="static",
        script=f"<script>{js}</script>",
    )
