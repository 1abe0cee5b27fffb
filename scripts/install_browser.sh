#!/usr/bin/env bash
# Install what the viewer's browser test needs: Debian's Chromium and the Playwright Python
# package. Playwright drives /usr/bin/chromium through executable_path, so no browser download.
# Usage: scripts/install_browser.sh [PYTHON]   (default: python on PATH, e.g. the active venv)
set -euo pipefail

PYTHON="${1:-python}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

if ! command -v chromium >/dev/null 2>&1; then
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
        chromium fonts-dejavu-core
fi

if ! "$PYTHON" -c "import playwright" >/dev/null 2>&1; then
    # Never downloads browsers: the test launches the system Chromium.
    PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 "$PYTHON" -m pip install -q "playwright>=1.40"
fi

chromium --version
"$PYTHON" -c "import playwright, importlib.metadata as m; print('playwright', m.version('playwright'))"
