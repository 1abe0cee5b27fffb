"""ALFWorld games' translations kept on disk: a game is translated once per machine, not once
per env worker and run.

Loading a game runs fast-downward's translator on its PDDL problem twice (0.1-0.5 s of CPU a
game on an idle core, about twice that on a busy machine). On a night every env worker loads
each game it meets, and a run's first trial loads them all: on the night benchmark this was
~70% of the env workers' CPU, while the GPU waited. What the translator computes depends only on
the domain and problem texts and on the translator's own code, so it is stored under a hash of
those (:meth:`TranslationStore.key`) and read back in a few milliseconds by any worker of any
later run: the two SAS texts and the facts the state starts with, as plain data (JSON,
compressed; 30-80 KB a game). :meth:`envs.fast_text.Translation.from_stored` rebuilds the rest.

An entry is used only when it names the same problem text, format and library versions; one
that cannot be read (truncated, corrupt) counts as absent and is written again. Writing is
atomic (:func:`memory.files.atomic_write`), so workers that translate the same game at once
each write a whole file. A cache that cannot be written (a read-only disk, a full one) is logged
once and the game is played as translated: the cache never fails a run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import zlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from memory.files import atomic_write

log = logging.getLogger(__name__)

DEFAULT_DIR = Path.home() / ".cache" / "reflexsim" / "alfworld-translations"
FORMAT = 1  # the layout of an entry; a change makes every older entry absent
_LIBRARIES = ("fast-downward-textworld", "textworld")  # whose translator and facts it holds


@functools.cache
def _library_versions() -> str:
    found = []
    for name in _LIBRARIES:
        try:
            found.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            found.append(f"{name}=?")
    return ";".join(found)


class TranslationStore:
    """A directory of translations, one file per (domain, problem, versions)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self._salt = f"{FORMAT};{sys.version_info[0]}.{sys.version_info[1]};{_library_versions()}"
        self._warned = False

    def key(self, domain: str, problem: str) -> str:
        digest = hashlib.sha256(self._salt.encode())
        for part in (domain, problem):
            digest.update(b"\0")
            digest.update(part.encode("utf-8"))
        return digest.hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json.z"

    def get(self, domain: str, problem: str) -> dict[str, Any] | None:
        """The stored translation of ``problem`` (a dict of what ``put`` was given), or None."""
        path = self._path(self.key(domain, problem))
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            entry = json.loads(zlib.decompress(blob))
            if not isinstance(entry, dict) or entry.get("pddl_problem") != problem:
                raise ValueError("the entry names another problem")
        except Exception as exc:
            log.warning("translation cache: %s is unreadable (%s); translating again", path, exc)
            return None
        return entry

    def put(self, domain: str, problem: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` (plain data for JSON; its ``pddl_problem`` must be ``problem``); a
        failure is logged once, never raised."""
        path = self._path(self.key(domain, problem))
        try:
            blob = zlib.compress(json.dumps(entry, separators=(",", ":")).encode(), 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "wb") as f:
                f.write(blob)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "translation cache: cannot write under %s (%s); games are translated as "
                    "they load (set another directory, or turn the cache off)",
                    self.root,
                    exc,
                )


def cache_dir(setting: str | None) -> str | None:
    """The directory a ``--translation-cache`` setting names: the default one for None, no
    directory (no cache) for ``off``."""
    if setting is None:
        return str(DEFAULT_DIR)
    return None if setting == "off" else setting
