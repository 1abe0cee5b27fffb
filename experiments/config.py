"""The run configuration: one frozen dataclass, parsed once from flags and an optional YAML file.

Flags override the file; unknown keys are errors. The resolved config goes into the manifest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError

ARMS = ("react", "reflexion", "reflexion+explore")
EVALUATORS = ("paper", "code", "llm")
ENVS = ("alfworld", "textworld")


@dataclass(frozen=True)
class RunConfig:
    model: str = "embedded"
    base_url: str | None = None
    reflect_model: str | None = None  # default: the actor's model
    agent: str = "reflexion"  # the arm
    evaluator: str = "paper"
    env: str = "alfworld"
    data: str | None = None  # ALFWorld data root (default $ALFWORLD_DATA, else generated games)
    split: str = "eval_out_of_distribution"
    games: int | None = None  # first N games of the split (sorted by id); None = all
    game_ids: tuple[str, ...] = ()  # explicit games
    task_types: tuple[str, ...] = ()
    trials: int = 3
    memory_size: int = 3
    max_steps: int = 30  # the paper's Reflexion runs (the originals allowed 49-50)
    count_thoughts: bool = True  # the originals count thoughts toward the step budget
    workers: int = 1
    concurrency: int = 4  # episodes in flight
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 100
    reflect_max_tokens: int = 256
    grounding: bool = True  # put X in/on Y -> move X to Y, lowercase, stray '>'
    prompts: str | None = None  # an original ReAct prompt file (react_<type>_<k>)
    chat_format: str | None = None  # how chat backends receive completion prompts
    run_dir: str | None = None
    budget_tokens: int | None = None
    budget_usd: float | None = None
    deadline: str | None = None  # wall-clock limit: "8h", "90m", "3600s", or an ISO time
    step_timeout_s: float = 120.0
    generate_per_type: int = 1  # games per type when generating the default game set
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    # serve a vllm: model for the run (experiments/serve.py); the command is a template
    serve: bool = False
    serve_command: str | None = None  # default: vllm serve {model} --host {host} --port {port}
    serve_port: int = 8000  # fixed, so that a resumed run finds its server at the same URL
    serve_timeout_s: float = 1800.0  # a first start may download the weights

    def __post_init__(self) -> None:
        if self.agent not in ARMS:
            raise ConfigError(f"unknown agent {self.agent!r}: use one of {', '.join(ARMS)}")
        if self.evaluator not in EVALUATORS:
            raise ConfigError(
                f"unknown evaluator {self.evaluator!r}: use one of {', '.join(EVALUATORS)}"
            )
        if self.env not in ENVS:
            raise ConfigError(f"unknown env {self.env!r}: use one of {', '.join(ENVS)}")
        for name in (
            "trials",
            "max_steps",
            "workers",
            "concurrency",
            "max_tokens",
            "reflect_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.memory_size < 0:
            raise ConfigError(f"memory-size must be >= 0, got {self.memory_size}")
        if self.games is not None and self.games < 1:
            raise ConfigError(f"games must be >= 1, got {self.games}")
        object.__setattr__(self, "task_types", tuple(self.task_types))
        object.__setattr__(self, "game_ids", tuple(self.game_ids))
        object.__setattr__(self, "backend_options", dict(self.backend_options))

    @property
    def actor_model(self) -> str:
        return self.model

    @property
    def reflector_model(self) -> str:
        return self.reflect_model or self.model

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["task_types"] = list(self.task_types)
        d["game_ids"] = list(self.game_ids)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def from_mapping(values: Mapping[str, Any], source: str = "config") -> RunConfig:
    """A RunConfig from a mapping; unknown keys (with '-' or '_') are errors."""
    clean: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(FIELDS))})")
        clean[name] = value
    try:
        return RunConfig(**clean)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return data


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` flags. Defaults are None so that only flags given override the file."""
    a = parser.add_argument
    a(
        "--config",
        help="YAML file of config keys, or a preset name (paper, scale, scale-cpu, ...): "
        "flags override it",
    )
    a(
        "--model",
        help="model spec: embedded[:gemma3-270m|smollm2-135m], vllm:ID, openai:MODEL, anthropic:MODEL, hf:ID, llamacpp:PATH, scripted:expert|random|learner|replay:DIR",
    )
    a("--base-url", help="OpenAI-compatible server URL (vllm serve, llama.cpp server)")
    a("--reflect-model", help="model spec for self-reflection (default: the actor's)")
    a(
        "--agent",
        choices=ARMS,
        help="arm: react (resampling baseline), reflexion, reflexion+explore",
    )
    a("--evaluator", choices=EVALUATORS, help="paper (default), code, or llm")
    a("--env", choices=ENVS, help="alfworld (default) or textworld")
    a("--data", help="ALFWorld data root (default: $ALFWORLD_DATA, else generated games)")
    a("--split", help="train, eval_in_distribution, eval_out_of_distribution")
    a("--games", type=int, help="play the first N games of the split (sorted by id)")
    a("--game", dest="game_ids", action="append", help="a game id to play (repeatable)")
    a("--task-types", nargs="+", help="put clean heat cool examine puttwo")
    a("--trials", type=int, help="number of trials")
    a("--memory-size", type=int, help="reflections shown to the actor (Omega)")
    a("--max-steps", type=int, help="step cap per episode")
    a(
        "--count-thoughts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="thoughts use up the step budget (the originals: yes)",
    )
    a("--workers", type=int, help="env worker processes")
    a("--concurrency", type=int, help="episodes in flight")
    a("--seed", type=int)
    a("--temperature", type=float)
    a("--max-tokens", type=int)
    a(
        "--grounding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite put X in/on Y to move X to Y",
    )
    a("--prompts", help="an original ReAct prompt file (JSON of react_<type>_<k> transcripts)")
    a("--chat-format", help="how chat backends receive completion prompts")
    a("--run-dir", help="where the run is written (default: runs/<time>-<model>-<arm>)")
    a("--budget-tokens", type=int, help="stop cleanly after this many tokens")
    a("--budget-usd", type=float, help="stop cleanly after this cost")
    a("--deadline", help="stop cleanly after this wall time (e.g. 8h, 90m) or at an ISO time")
    a(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start `vllm serve` for the vllm: model, restart it if it dies, stop it at the end",
    )
    a(
        "--serve-command",
        help="server command template with {model} {host} {port} {python} "
        "(default: vllm serve {model} --host {host} --port {port})",
    )
    a("--serve-port", type=int, help="port of the served model on 127.0.0.1 (default 8000)")
    a("--resume", metavar="DIR", help="continue the run in DIR")
    a("--force", action="store_true", help="resume even if the manifest does not match")
    a("--dry-run", action="store_true", help="print the resolved plan and exit")


_NOT_CONFIG = {"config", "resume", "force", "dry_run", "handler", "command"}


def resolve(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge: defaults < base (e.g. a resumed manifest) < YAML file < flags given."""
    values: dict[str, Any] = dict(base or {})
    if getattr(args, "config", None):
        values.update(load_yaml(args.config))
    for key, value in vars(args).items():
        if key in _NOT_CONFIG or value is None:
            continue
        values[key] = value
    return from_mapping(values, source=getattr(args, "config", None) or "flags")


def parse_deadline(value: str | None, start: float) -> float | None:
    """Seconds since the epoch at which to stop, from '8h', '90m', '3600s', '3600' or ISO time."""
    if value is None:
        return None
    text = value.strip().lower()
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    try:
        if text[-1:] in units:
            return start + float(text[:-1]) * units[text[-1]]
        return start + float(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ConfigError(
            f"bad deadline {value!r}: use e.g. 8h, 90m, 3600s or an ISO time"
        ) from None
