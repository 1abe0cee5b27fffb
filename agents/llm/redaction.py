"""Secrets out of what the project writes or prints of its configuration: one pass,
:func:`redact`, over a value of any shape (a config, a manifest, a server's command line and
environment, a log line, an error message).

- a mapping loses every entry whose name says it holds a secret (:func:`secret_name`: a word
  of it is key, token, secret, password, auth, credential, ...; ``api_key_env``, which names
  an environment variable, is kept), at any depth (``extra_body``, a role's options);
- a list of words (a command line) has the value after such an option (``--api-key KEY``)
  replaced by ``<redacted>``;
- a text has every URL without its user info, query and fragment (with or without a scheme:
  ``user:KEY@host`` becomes ``host``), and the value of each ``NAME=VALUE``, ``NAME: VALUE``
  and ``--NAME VALUE`` whose name says it holds a secret replaced by ``<redacted>``.

A value recorded with ``<redacted>`` in it cannot be used again as it is: a resume is told to
pass it again (:data:`REDACTED`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

# the words of a name: snake_case, kebab-case, dotted, camelCase and UPPER_CASE alike
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
SECRET_WORDS = frozenset(
    {
        "key", "apikey", "token", "secret", "secrets", "password", "passwd", "passphrase",
        "auth", "authorization", "credential", "credentials", "bearer", "cookie",
    }
)  # fmt: skip

# a URL with a scheme: scheme, authority (user info, host, port), path, query and fragment
_URL = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#\s,'\"]*)"
    r"(?P<path>[^?#\s,'\"]*)(?P<rest>[?#][^\s,'\"]*)?"
)
# user info without a scheme: ``user:KEY@host``
_USERINFO = re.compile(r"(?<![\w.-])[^\s/@,'\"=]+:[^\s/@,'\"]*@(?=[\w\[])")
# a secret word at the end of a name (in the text lowered), then a separator: NAME=VALUE,
# NAME: VALUE, "NAME": "VALUE", --NAME VALUE; a name found is checked by :func:`secret_name`.
# Looked for from each place a root occurs (str.find): a long text takes microseconds.
_ROOTS = ("key", "token", "secret", "pass", "auth", "credential", "bearer", "cookie")
_HINT = re.compile(
    r"(?:key|token|secrets?|password|passwd|passphrase|auth|authorization|credentials?|bearer"
    r"|cookie)(?![a-z])[\w.-]*[\"']?(?=\s*[=:,]|\s)"
)
# the separator (``,`` between the words of a printed list: ``['--api-key', 'KEY']``) and the
# value: a word, a quoted text, or a list (``'api_key': ['KEY']``, as vLLM prints its arguments)
_VALUE = re.compile(
    r"[\"']?(?P<sep>\s*[=:]\s*|\s*,\s*|\s+)(?P<value>(?:(?i:bearer|basic|token)\s+)?"
    r"(?:\"[^\"]*\"|'[^']*'|\[[^\]]*\]|[^\s,;&'\"{}\[\]]+))"
)
_NAME_CHAR = re.compile(r"[\w.-]")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def secret_name(name: object) -> bool:
    """Whether an option or key named ``name`` holds a secret (``api_key``, ``x-api-key``,
    ``apiKey``, ``HF_TOKEN``, ``--password``, ``reflect.client_secret``), not a count or a
    reference to one (``max_tokens``, ``api_key_env``)."""
    return _secret_name(name if isinstance(name, str) else str(name))


@functools.lru_cache(maxsize=4096)  # every recorded request asks again for the same keys
def _secret_name(name: str) -> bool:
    words = [w.lower() for w in _WORD.findall(name)]
    if not words or words[-1] == "env":
        return False
    return any(w in SECRET_WORDS for w in words)


def redact(value: Any) -> Any:
    """``value`` as the project writes or prints it (see the module docstring); tuples become
    lists, everything else keeps its type."""
    if isinstance(value, str):
        return _redact_text(value)
    if isinstance(value, Mapping):
        return {k: redact(v) for k, v in value.items() if not secret_name(k)}
    if isinstance(value, list | tuple):
        out = [redact(v) for v in value]
        for i in range(1, len(out)):  # a command line: --api-key KEY
            before = value[i - 1]
            if (
                isinstance(before, str)
                and before.startswith("-")
                and "=" not in before
                and secret_name(before)
                and not str(value[i]).startswith("-")
            ):
                out[i] = REDACTED
        return out
    return value


def _redact_text(text: str) -> str:
    # each pass only where it can find something: a model's grammar or a long log line is
    # looked through in microseconds
    if "://" in text:
        text = _URL.sub(_bare_url, text)
    if "@" in text:
        text = _USERINFO.sub("", text)
    out, pos = [], 0
    for hint in _hints(text):
        start = hint.start()
        while start > 0 and _NAME_CHAR.match(text[start - 1]):
            start -= 1
        if start < pos:
            continue
        name = text[start : hint.end()].strip("\"'")
        m = _VALUE.match(text, start + len(name))
        if m is None or not _holds_secret(name, m):
            continue
        out.append(text[pos : m.start("value")] + REDACTED)
        pos = m.end()
    return "".join(out) + text[pos:] if out else text


def _hints(text: str) -> list[re.Match[str]]:
    """Where a secret word ends a name that a separator follows, in order."""
    low = text.lower()
    if len(low) != len(text):  # a character whose lower case is longer: A-Z only
        low = text.translate(_ASCII_LOWER)
    found = {}
    for root in _ROOTS:
        at = low.find(root)
        while at >= 0:
            hint = _HINT.match(low, at)
            if hint is not None:
                found[at] = hint
            at = low.find(root, at + 1)
    return [found[at] for at in sorted(found)]


def _bare_url(m: re.Match[str]) -> str:
    authority = m["authority"]
    if "@" in authority:
        authority = authority.rpartition("@")[2]
    elif re.search(r":(?!\d*$)", authority) and not authority.startswith("["):
        authority = REDACTED  # ``user:KEY`` whose host was cut off (a space before ``@host``)
    return f"{m['scheme']}{authority}{m['path']}"


def _holds_secret(name: str, m: re.Match[str]) -> bool:
    if not secret_name(name.lstrip("-")):
        return False
    if m["sep"].strip() in ("=", ":"):
        return True
    # after a space or a comma only an option's value: ``word value`` is prose, and ``--flag
    # --other`` has no value
    return name.startswith("-") and not m["value"].strip("'\"").startswith("-")
