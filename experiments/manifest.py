"""A run's manifest: what it was made with (config, games, prompt files, versions, models), and
what a resume may change of it (:func:`~experiments.config.resumable_keys`) without ``--force``."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from agents.llm.base import Backend, GenerationConfig
from agents.llm.redaction import redact
from agents.llm.vllm_backend import engine_record
from agents.prompting import file_sha256, template_hashes
from experiments.config import RunConfig, public_values, resumable_keys
from experiments.games import GameSet

ACTION_SYNTAX = "alfworld-0.4 (move X to Y; You arrive at <receptacle>)"


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("reflexsim", "alfworld", "textworld", "gymnasium", "vllm", "openai", "anthropic",
                 "transformers", "torch", "llama-cpp-python"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def build_manifest(
    cfg: RunConfig,
    games: GameSet,
    actor: Backend,
    reflector: Backend,
    data: str | None,
    prompt_files: dict[str, str],
    generation: GenerationConfig,
) -> dict[str, Any]:
    """``prompt_files``: the sha256 of each prompt file the user gave; ``generation``: the
    actor's sampling settings."""

    def describe(b: Backend) -> Any:  # its options, URL and extra body: without secrets
        fn = getattr(b, "describe", None)
        return redact(fn()) if callable(fn) else {"name": b.name}

    return {
        "config": cfg.to_dict(public=True),
        "data_root": data,
        "versions": _versions(),
        "git_commit": _git_commit(),
        "action_syntax": ACTION_SYNTAX,
        "games": {g: file_sha256(p) for g, p in sorted(games.files.items())},
        "prompt_templates": template_hashes(),
        "prompts_file": file_sha256(Path(cfg.protocol.prompts)) if cfg.protocol.prompts else None,
        "protocol": cfg.protocol.protocol,
        "prompt_files": prompt_files,
        # a vllm: model's engine: sampling defaults in force, batch invariance, vLLM version
        "vllm": redact(
            engine_record(
                cfg.models.model, cfg.models.base_url, cfg.server.serve, cfg.server.serve_command
            )
        ),
        "actor": describe(actor),
        "reflector": describe(reflector),
        "generation": generation.__dict__,
        "seed": cfg.protocol.seed,
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "started_at": time.time(),
    }


def manifest_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between a run's manifest and a resume's, beyond the resumable keys."""
    diffs = []
    # public copies: a manifest written before secrets were left out compares (and prints) alike
    old_cfg, new_cfg = public_values(old.get("config", {})), public_values(new.get("config", {}))
    defaults = RunConfig().to_dict()
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if key in resumable_keys():
            continue
        # a key a newer version added reads as its default in an older manifest
        was, now = old_cfg.get(key, defaults.get(key)), new_cfg.get(key, defaults.get(key))
        if was != now:
            diffs.append(f"{key}: {was!r} -> {now!r}")
    for key in ("games", "prompt_templates", "prompts_file", "action_syntax", "experience"):
        if old.get(key) != new.get(key):
            diffs.append(f"{key} changed")
    if old.get("prompt_files", {}) != new.get("prompt_files", {}):  # older manifests lack it
        diffs.append("prompt_files changed")
    return diffs


def resumed_manifest(old: dict[str, Any], cfg: RunConfig, diffs: list[str]) -> dict[str, Any]:
    """The manifest a resume records: the run's own, with the resumable keys it was given now
    and what differed (``diffs``, accepted with ``--force``)."""
    manifest = {**old, "resumed_at": time.time(), "resume_differences": diffs}
    manifest["config"] = {
        **old.get("config", {}),
        **{k: v for k, v in cfg.to_dict(public=True).items() if k in resumable_keys()},
    }
    return manifest
