"""A real headless Chromium for the viewer's browser tests: Debian's chromium driven by
Playwright (scripts/install_browser.sh); a test that asks for it is skipped without them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 10_000


@contextmanager
def launch(profile: Path) -> Iterator[Any]:
    """A browser context on a fresh user-data dir ``profile``. Playwright's event loop runs in
    the thread while it is open: an ``asyncio.run`` (a run) must come before or after it."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed")
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium not installed (scripts/install_browser.sh)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=ARGS
        )
        context.set_default_timeout(TIMEOUT_MS)
        yield context
        context.close()


class Page:
    """A page that records script errors and console errors (CSP violations included)."""

    def __init__(self, context: Any) -> None:
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on(
            "console",
            lambda msg: self.errors.append(f"console: {msg.text}") if msg.type == "error" else None,
        )
