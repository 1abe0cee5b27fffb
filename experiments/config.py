"""The run configuration: one tree of frozen dataclasses, the single source of every option.

Each leaf field is declared once, with :func:`~agents.options.option` (default, docstring, and
what the tree derives from it). The run's own sections are declared here; an arm's options are
its own section, declared in its module and named by its :class:`~agents.arm.Arm` record: the
tree takes the registered arms' sections from the registry (:func:`section_types`), so an arm
registered later brings its flags, YAML keys and ``--help`` with it. From the tree come: the
``run`` flags and ``--help`` (one argparse group per section, a flag per leaf), the YAML keys (a
leaf's own name, at the top level as always, or inside its section: ``protocol: {trials: 5}``),
the keys that may change on ``--resume`` (``resumable=True``), validation (``choices``,
``minimum``), and the manifest (:meth:`to_dict`). Leaf names are unique across sections
(:func:`agents.options.declare` refuses a clash), so today's flat keys keep working everywhere.

A small generator of its own rather than a CLI library: the flags and YAML keys are an existing
public surface (``--game`` repeats, ``--no-count-thoughts``, only flags given override a file or
a resumed manifest), which a generated CLI would rename.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agents import arms
from agents.arm import RUN_ROLES
from agents.llm.redaction import REDACTED, redact
from agents.options import declare, help_text, leaf_names, model_spec, option
from agents.reflexion_code import CODE_PROTOCOL
from experiments.errors import ConfigError

REFLECTION_FORMATS = ("free", "critique")
EVALUATORS = ("paper", "code", "llm")
PROTOCOLS = ("reflexsim", CODE_PROTOCOL)
ENVS = ("alfworld", "textworld")
SPLITS = ("train", "eval_in_distribution", "eval_out_of_distribution")


def _choices(meta: Mapping[str, Any]) -> tuple[str, ...] | None:
    choices = meta["choices"]
    return choices() if callable(choices) else choices


def model_roles() -> tuple[str, ...]:
    """Every role a backend may be made for: the run's, then the registered arms' own."""
    return (*RUN_ROLES, *arms.role_names())


def role_options_of(options: Mapping[str, Any], role: str) -> dict[str, Any]:
    """One role's own backend options, from ``ROLE.KEY: VALUE`` keys (or a ``ROLE:`` mapping)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name, _, leaf = str(key).partition(".")
        if name == role and leaf:
            out[leaf] = value
        elif name == role and isinstance(value, Mapping):
            out.update({str(k): v for k, v in value.items()})
    return out


def _role_options(value: Mapping[str, Any]) -> None:
    for key, item in value.items():
        role, _, leaf = str(key).partition(".")
        if role not in model_roles() or not (leaf or isinstance(item, Mapping)):
            raise ValueError(
                f"{key!r} is not ROLE.KEY with ROLE one of {', '.join(model_roles())} "
                "(e.g. reflect.gpu_memory_utilization=0.3)"
            )


def _base_urls(value: str) -> None:
    """Each of a comma-separated list: an http(s) URL with a host, a port in range and no space
    (the message shows it without its secrets)."""
    for url in value.split(","):
        url = url.strip()
        shown = repr(redact(url))
        if not re.fullmatch(r"https?://[^\s/?#]+\S*", url, re.I):
            why = "has a space" if re.search(r"\s", url) else "is not an http:// or https:// URL"
            raise ValueError(f"{shown} {why}: give the server's URL, e.g. http://127.0.0.1:8000/v1")
        parts = urlsplit(url)
        try:
            port = parts.port  # raises on a port out of range or not a number
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError(f"{shown} has a bad port: use a port in 1-65535")
        if not parts.hostname:
            raise ValueError(f"{shown} names no host: e.g. http://127.0.0.1:8000/v1")


def _deadline(value: str) -> None:
    parse_deadline(value, 0.0)


def _per_type(value: int) -> None:
    from envs.alfgen.generator import check_per_type  # lazily: envs imports gymnasium

    check_per_type(value)


@dataclass(frozen=True)
class ModelConfig:
    """The models and how they are asked."""

    model: str = option(
        "embedded",
        "model spec: embedded[:gemma3-270m|smollm2-135m], vllm:ID, openai:MODEL, "
        "anthropic:MODEL, hf:ID, llamacpp:PATH, scripted:expert|random|learner|replay:DIR",
        check=model_spec,
    )
    base_url: str | None = option(
        None,
        "OpenAI-compatible server URL (vllm serve, llama.cpp server); several, comma-separated, "
        "shard the games across servers",
        check=_base_urls,
    )
    reflect_model: str | None = option(
        None, "model spec for self-reflection (default: the actor's)", check=model_spec
    )
    chat_format: str | None = option(None, "how chat backends receive completion prompts")
    backend_options: dict[str, Any] = option(
        {},
        "backend keyword options (e.g. n_threads=1, concurrency=16; for HTTP backends "
        "timeout=SECONDS is the deadline of one whole attempt, connect to last byte, and "
        "max_retries=N more attempts each get their own); flag: --backend-option KEY=VALUE, "
        "repeatable",
        flag="--backend-option",
    )
    role_options: dict[str, Any] = option(
        {},
        lambda: (
            "one role's backend options over backend_options, ROLE.KEY=VALUE with ROLE one "
            f"of {', '.join(model_roles())} (e.g. reflect.gpu_memory_utilization=0.3); a role with "
            "options of its own gets its own backend even when it names the actor's model; flag: "
            "--role-option ROLE.KEY=VALUE, repeatable"
        ),
        flag="--role-option",
        check=_role_options,
    )
    action_decoding: str = option(
        "free",
        "free (the model's text as it is), grounded (the serving engine's constrained decoding "
        "allows only a think: line or one admissible command), or nearest (free text mapped to "
        "the most similar admissible command; any backend)",
        choices=("free", "grounded", "nearest"),
    )
    temperature: float = option(0.0, "actor sampling temperature", minimum=0.0)
    top_p: float = option(1.0, "actor nucleus sampling", above=0.0, maximum=1.0)
    max_tokens: int = option(100, "actor tokens per step at most", minimum=1)
    reflect_max_tokens: int = option(256, "tokens per reflection at most", minimum=1)

    @property
    def reflector(self) -> str:
        return self.reflect_model or self.model


@dataclass(frozen=True)
class ProtocolConfig:
    """The agent arm and the trial protocol."""

    agent: str = option(
        "reflexion",
        arms.described,  # read when shown, as the choices: an arm registered later is listed
        choices=arms.names,
    )
    trials: int = option(3, "number of trials", minimum=1, resumable=True)
    memory_size: int = option(3, "reflections shown to the actor (Omega)", minimum=0)
    max_steps: int = option(
        30, "step cap per episode (the paper's Reflexion runs: 30; the originals: 49-50)", minimum=1
    )
    count_thoughts: bool = option(
        True, "thoughts use up the step budget and the evaluator's action count (originals: yes)"
    )
    grounding: bool = option(
        True,
        "rewrite the action: lowercase it, strip a leading '>', and put X in/on Y to move X to Y "
        "(ALFWorld 0.4 syntax); the reflexion-code protocol never rewrites",
    )
    prompts: str | None = option(
        None, "an original ReAct prompt file (JSON of react_<type>_<k> transcripts)"
    )
    protocol: str = option(
        "reflexsim",
        "prompt layout and action handling: reflexsim (this project's own) or reflexion-code "
        "(what the paper's code sends, byte for byte; needs --prompts, --instruction-file, "
        "--reflection-template and --reflection-examples)",
        choices=PROTOCOLS,
    )
    instruction_file: str | None = option(
        None,
        "a file whose text (its newline included) is the actor's instruction, put before the "
        "two examples; without it, the packaged instruction",
    )
    reflection_template: str | None = option(
        None,
        "reflexion-code: the reflection prompt template, with {examples}, {trajectory} and "
        "{past_plans} (its last newline is dropped)",
    )
    reflection_examples: str | None = option(
        None, "reflexion-code: the reflection's few-shot examples file, put in verbatim"
    )
    code_put_to_move: bool = option(
        False,
        "reflexion-code: send put X in/on Y to the env as move X to Y (ALFWorld 0.4 syntax; "
        "the prompt shows what was sent); off, as in the code",
    )
    seed: int = option(0, "run seed (sampling, generated games)")

    def __post_init__(self) -> None:
        if self.protocol == CODE_PROTOCOL:
            arm = arms.find(self.agent)
            if arm is not None and not arm.code_protocol:
                played = " or ".join(a for a in arms.names() if arms.get(a).code_protocol)
                raise ConfigError(
                    f"--protocol {CODE_PROTOCOL} plays the paper code's arms only: --agent "
                    f"{played}, not {self.agent}"
                )
        else:
            given = [
                n
                for n in ("reflection_template", "reflection_examples", "code_put_to_move")
                if getattr(self, n)
            ]
            if given:
                raise ConfigError(
                    f"--{given[0].replace('_', '-')} is read only by --protocol reflexion-code"
                )


@dataclass(frozen=True)
class EvaluationConfig:
    """When an episode counts as failed (success is always the env's won)."""

    evaluator: str = option(
        "paper",
        "paper (same action and observation repeated, or too many actions), code (the same "
        "action twice in a row), or llm (a judge reads the transcript)",
        choices=EVALUATORS,
    )
    max_actions: int = option(
        30, "paper evaluator: fail after more than this many actions (the paper: 30)", minimum=1
    )
    max_repeats: int = option(
        3,
        "paper evaluator: fail when the same action got the same observation more than this "
        "many times in a row (the paper: 3)",
        minimum=1,
    )


@dataclass(frozen=True)
class GamesConfig:
    """Which games are played."""

    env: str = option("alfworld", "alfworld or textworld", choices=ENVS)
    data: str | None = option(
        None, "ALFWorld data root (default: $ALFWORLD_DATA, else generated games)"
    )
    split: str = option("eval_out_of_distribution", "ALFWorld split", choices=SPLITS)
    games: int | None = option(
        None, "play the first N games of the split (sorted by id)", minimum=1
    )
    game_ids: tuple[str, ...] = option((), "a game id to play (repeatable)", flag="--game")
    task_types: tuple[str, ...] = option((), "only these: put clean heat cool examine puttwo")
    generate_per_type: int = option(
        1, "games per task type when generating the default game set", minimum=1, check=_per_type
    )

    def __post_init__(self) -> None:
        if self.env == "textworld" and self.task_types:
            raise ConfigError(
                f"--task-types {' '.join(self.task_types)} picks ALFWorld task types; "
                "--env textworld games have none: drop --task-types (or pick games with --game)"
            )


# The most games --reset-cache keeps by default (a worker keeps only the games it loaded, and a
# game goes back to the worker that loaded it: ~1 GB a worker at most).
MAX_RESET_CACHE = 256


@dataclass(frozen=True)
class ExecutionConfig:
    """How the run uses the machine (never changes results)."""

    workers: int = option(1, "env worker processes", minimum=1, resumable=True)
    reset_cache: int | None = option(
        None,
        "ALFWorld games whose parsed state each env worker keeps, so that a later reset of one "
        "skips loading it (~4 MB each, for the games the worker has loaded; 0: none); each "
        f"trial resets every game again (default: the run's games, at most {MAX_RESET_CACHE})",
        minimum=0,
        resumable=True,
    )
    translation_cache: str | None = option(
        None,
        "directory where ALFWorld games' translations are kept for every later env worker and "
        "run, so that a game is translated once per machine (default: "
        "~/.cache/reflexsim/alfworld-translations; off: none)",
        resumable=True,
    )
    concurrency: int = option(
        4,
        "episodes in play (sending model requests); one more per worker resets its game ahead",
        minimum=1,
        resumable=True,
    )
    harness_procs: int = option(
        1,
        "runner processes the run's games are shared among (one store, one run; --concurrency "
        "and --workers are the run's, split among them): for a GPU one process cannot feed",
        minimum=1,
        resumable=True,
    )
    step_timeout_s: float = option(
        120.0, "seconds an env call may take before its worker is replaced", minimum=0.001,
        resumable=True,
    )  # fmt: skip
    run_dir: str | None = option(
        None, "where the run is written (default: runs/<time>-<model>-<arm>)", resumable=True
    )


@dataclass(frozen=True)
class BudgetConfig:
    """When to stop cleanly (a stopped run continues with --resume)."""

    budget_tokens: int | None = option(
        None, "stop after this many tokens", minimum=1, resumable=True
    )
    budget_usd: float | None = option(None, "stop after this cost", minimum=0.0, resumable=True)
    deadline: str | None = option(
        None,
        "stop after this wall time (8h, 90m, 3600s) or at an ISO time",
        check=_deadline,
        resumable=True,
    )


@dataclass(frozen=True)
class ServeConfig:
    """A model server started for the run (vllm: models)."""

    serve: bool = option(
        False, "start `vllm serve` for the vllm: model, restart it if it dies, stop it at the end"
    )
    serve_command: str | None = option(
        None,
        "server command template with {model} {host} {port} {python} "
        "(default: vllm serve {model} --host {host} --port {port} --generation-config vllm "
        "--enable-prompt-tokens-details)",
    )
    serve_port: int = option(
        8000, "port of the served model on 127.0.0.1", minimum=1, maximum=65535
    )
    serve_timeout_s: float = option(
        1800.0, "seconds to wait for the server to become healthy (a first start downloads)",
        minimum=1.0,
    )  # fmt: skip
    serve_data_parallel: int = option(
        1,
        "vLLM data-parallel replicas behind the one served URL, one per GPU of this node "
        "(adds --data-parallel-size N to serve-command)",
        minimum=1,
        resumable=True,
    )


@dataclass(frozen=True)
class ClusterConfig:
    """Beyond one machine, on Ray (pip install reflexsim[ray]); never changes results."""

    ray: str | None = option(
        None,
        "a Ray cluster: its address (auto, host:port, ray://host:10001) or local (a private "
        "cluster on this machine); a preset's jobs then run as Ray tasks, in parallel where "
        "resources allow; off: no Ray (e.g. to resume a Ray matrix on this machine)",
        resumable=True,
    )
    env_workers_on_ray: bool = option(
        False,
        "step the run's envs in --workers Ray actors spread over the cluster (needs --ray)",
        resumable=True,
    )
    env_worker_cpus: float = option(
        1.0, "CPUs each Ray env worker reserves", minimum=0.0, resumable=True
    )
    harness_procs_on_ray: bool = option(
        False,
        "with --harness-procs 2 or more: start the runner processes as Ray actors (a CPU "
        "each) on this node, which holds the run's store (needs --ray)",
        resumable=True,
    )
    gpus: float | None = option(
        None,
        "GPUs a job (or each served replica) reserves on Ray (default: 0 for API and scripted "
        "models; for vllm: models the product of the tensor, pipeline and data parallel sizes "
        "in serve-command, at least 1)",
        minimum=0.0,
        resumable=True,
    )
    gpu_resource: str = option(
        "GPU",
        "the Ray resource a job's GPUs are counted in (GPU, or a custom resource name)",
        resumable=True,
    )
    job_cpus: float | None = option(
        None,
        "CPUs a job reserves on Ray (default: its --workers; 1 with --env-workers-on-ray)",
        minimum=0.0,
        resumable=True,
    )
    job_retries: int = option(
        3,
        "times a job whose node or worker died is submitted again (it resumes from its store)",
        minimum=0,
        resumable=True,
    )
    serve_replicas: int = option(
        1,
        "with --ray and --serve: this many model servers, started as Ray actors on any node "
        "(gpus each); the games are sharded across them as with a --base-url list",
        minimum=1,
        resumable=True,
    )

    @property
    def address(self) -> str | None:
        """The Ray cluster to use, or None (no ``ray``, or ``off``)."""
        return None if (self.ray or "off").strip().lower() == "off" else self.ray

    def __post_init__(self) -> None:
        for flag, on in (
            ("--env-workers-on-ray", self.env_workers_on_ray),
            ("--harness-procs-on-ray", self.harness_procs_on_ray),
        ):
            if on and not self.address:
                raise ConfigError(f"{flag} needs --ray ADDRESS (or --ray local)")
        if self.serve_replicas > 1 and not self.address:
            raise ConfigError(
                f"--serve-replicas {self.serve_replicas} starts servers on a Ray cluster: add "
                "--ray ADDRESS (or --ray local), or give servers you started as a --base-url list"
            )


@dataclass(frozen=True)
class SafeguardConfig:
    """Safeguards of reflect-then-retry (each is recorded with the run)."""

    reflection_format: str = option(
        "free",
        "free (a paragraph) or critique (JSON {missing, superfluous, plan}; free text is kept, "
        "with the parse error recorded, when it does not parse)",
        choices=REFLECTION_FORMATS,
    )
    reflection_max_chars: int | None = option(
        None, "cap on a reflection's length in characters (truncation is recorded)", minimum=1
    )
    task_max_tokens: int | None = option(
        None, "tokens per task across its trials; a task past it is not retried", minimum=1
    )
    task_max_seconds: float | None = option(
        None, "wall time per task across its trials; a task past it is not retried", minimum=0.0
    )
    oscillation_stop: bool = option(
        False,
        "stop retrying a task whose trial repeats an earlier trial's actions exactly "
        "(failure class oscillating)",
    )
    escalate_model: str | None = option(
        None,
        "model spec that re-runs each task still unsolved after the last trial, once "
        "(reported apart from the trials)",
        check=model_spec,
    )


def _arm_defaults() -> tuple[tuple[str, Any], ...]:
    return tuple((key, kind()) for key, kind in arms.sections().items())


@dataclass(frozen=True)
class RunConfig:
    """The whole configuration of a run: one section per concern, then the registered arms'
    sections (``arm_sections``: ``(key, section)`` pairs; read one with :meth:`section`)."""

    models: ModelConfig = field(default_factory=ModelConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    gameset: GamesConfig = field(default_factory=GamesConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    server: ServeConfig = field(default_factory=ServeConfig)
    safeguards: SafeguardConfig = field(default_factory=SafeguardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    arm_sections: tuple[tuple[str, Any], ...] = field(default_factory=_arm_defaults)

    def section(self, key: str) -> Any:
        """The section ``key``: the run's own or a registered arm's (its defaults when the arm
        was registered after this config was made)."""
        if key in CORE_SECTIONS:
            return getattr(self, key)
        found = dict(self.arm_sections).get(key)
        if found is not None:
            return found
        kind = arms.sections().get(key)
        if kind is None:
            raise KeyError(f"no config section {key!r}")
        return kind()

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """A config from leaf keys (``RunConfig.of(model="scripted:expert", trials=2)``)."""
        return from_mapping(values, source="RunConfig.of")

    def replace(self, **values: Any) -> RunConfig:
        """A copy with some leaves changed (validated like any other config)."""
        return from_mapping({**self.to_dict(), **values}, source="replace")

    def to_dict(self, *, public: bool = False) -> dict[str, Any]:
        """Every leaf by name (flat: leaf names are unique). ``public``: the copy the project
        writes or prints (the manifest's ``config``, config.yaml, ``--verbose``), without
        secrets (see :func:`public_values`)."""
        out: dict[str, Any] = {}
        for key, kind in section_types().items():
            section = self.section(key)
            for name in leaf_names(kind):
                value = getattr(section, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        return public_values(out) if public else out

    def to_tree(self, *, public: bool = False) -> dict[str, dict[str, Any]]:
        """The same, by section (config.yaml and ``--verbose`` write it with ``public``)."""
        flat = self.to_dict(public=public)
        return {s: {n: flat[n] for n in leaf_names(t)} for s, t in section_types().items()}


def public_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Config values safe to write or print (:func:`agents.llm.redaction.redact`): every URL
    without user info, query or fragment (a key in ``--base-url`` is never written, so pass it
    again with ``--resume``), options named like a key, token or password left out (nested
    mappings too: backend options, a preset's base and jobs), and the value of such an option
    in a command (``--serve-command '... --api-key KEY'``) written as ``<redacted>``."""
    return dict(redact(dict(values)))


# The run's own sections (every RunConfig field but the arms'), declared so that an arm's section
# that reuses one of their keys is refused when the arm is registered.
CORE_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RunConfig)
    if f.name != "arm_sections"
}
for _key, _kind in CORE_SECTIONS.items():
    declare(_key, _kind)


def section_types() -> dict[str, type]:
    """Every section by key: the run's own, then the registered arms' (read now: an arm
    registered later brings its section)."""
    return {**CORE_SECTIONS, **arms.sections()}


def leaves() -> dict[str, tuple[str, dataclasses.Field[Any]]]:
    """Every leaf by name: its section's key and its field."""
    return {f.name: (s, f) for s, t in section_types().items() for f in dataclasses.fields(t)}


def resumable_keys() -> frozenset[str]:
    """The keys that may change on ``--resume``."""
    return frozenset(n for n, (_, f) in leaves().items() if f.metadata["resumable"])


def _hints(section: str) -> dict[str, Any]:
    return typing.get_type_hints(section_types()[section])


def _base_type(hint: Any) -> Any:
    """int for ``int | None``, tuple for ``tuple[str, ...]``, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Union or (origin is not None and type(None) in typing.get_args(hint)):
        return _base_type(args[0])
    return origin or hint


def _unknown(key: str, known: list[str], source: str, where: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f": did you mean {close[0]!r}?" if close else f" (known: {', '.join(sorted(known))})"
    return ConfigError(f"{source}: unknown key {(where + key)!r}{hint}")


def _coerce(name: str, value: Any, source: str) -> Any:
    section, f = leaves()[name]
    kind = _base_type(_hints(section)[name])
    if value is None:
        return None
    try:
        value = _typed(kind, value)
    except (TypeError, ValueError):
        # a value in an error message is printed: without its secrets
        shown = redact(value)
        raise ConfigError(f"{source}: {name} must be {_KIND_WORDS[kind]}, got {shown!r}") from None
    meta, flag = f.metadata, name.replace("_", "-")
    if REDACTED in repr(value):
        raise ConfigError(
            f"{source}: {flag} holds {REDACTED}: a run records it without its secret, so a "
            f"resume needs it again: pass {meta['flag'] or '--' + flag} (with the key) again"
        )
    choices = _choices(meta)
    if choices and value not in choices:
        raise ConfigError(
            f"{source}: unknown {name} {redact(value)!r}: use one of {', '.join(choices)}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{source}: {flag} must be a finite number, got {value}: give a number, or leave it "
            "out for the default"
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high, above = meta["minimum"], meta["maximum"], meta["above"]
        if low is not None and value < low:
            raise ConfigError(f"{source}: {flag} must be >= {low:g}, got {value}")
        if above is not None and value <= above:
            raise ConfigError(f"{source}: {flag} must be > {above:g}, got {value}")
        if high is not None and value > high:
            raise ConfigError(f"{source}: {flag} must be <= {high:g}, got {value}")
    if meta["check"] is not None:
        try:
            meta["check"](value)
        except ValueError as exc:
            raise ConfigError(f"{source}: {flag}: {exc}") from None
    return value


_KIND_WORDS: dict[Any, str] = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "text (one value; in YAML quote words like 'off' or 'no')",
    tuple: "a list of names",
    dict: "a mapping of KEY: VALUE",
}


def _typed(kind: Any, value: Any) -> Any:
    """``value`` as a leaf of type ``kind``; TypeError/ValueError when it is not one (a YAML list
    where one name belongs, a mapping where a list does, a bool where a number does)."""
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError
        return value
    if isinstance(value, bool) and kind is not str:
        raise TypeError
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise TypeError
        return value
    if kind is float:
        if not isinstance(value, int | float | str):
            raise TypeError
        return float(value)
    if kind is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise TypeError  # YAML's `off`/`no` read as false: quote them
        return str(value)
    if kind is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(
            isinstance(v, str | int) and not isinstance(v, bool) for v in items
        ):
            raise TypeError
        return tuple(str(v) for v in items)
    if kind is dict:
        if not isinstance(value, Mapping):
            raise TypeError
        return dict(value)
    return value


def flatten(values: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Leaf keys from a mapping of leaf keys and/or sections; unknown keys are errors that name
    the closest known key."""
    out: dict[str, Any] = {}
    kinds, known = section_types(), leaves()
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in kinds and isinstance(value, Mapping):
            names = leaf_names(kinds[name])
            for sub, v in value.items():
                leaf = str(sub).replace("-", "_")
                if leaf not in names:
                    raise _unknown(leaf, list(names), source, f"{name}.")
                out[leaf] = v
            continue
        if name not in known:
            raise _unknown(name, [*known, *kinds], source)
        out[name] = value
    return out


def from_mapping(values: Mapping[str, Any], source: str = "config") -> RunConfig:
    """A RunConfig from leaf keys and/or sections (``-`` or ``_``); checked leaf by leaf."""
    flat = {n: _coerce(n, v, source) for n, v in flatten(values, source).items()}
    sections = {
        s: kind(**{n: flat[n] for n in leaf_names(kind) if n in flat})
        for s, kind in section_types().items()
    }
    core = {s: sections.pop(s) for s in CORE_SECTIONS}
    return RunConfig(**core, arm_sections=tuple(sections.items()))


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml  # lazily: PyYAML costs ~25 ms; only reading or writing YAML needs it

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {str(path)!r} is not text: pass a YAML file of config keys"
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return data


def data_root(cfg: RunConfig) -> str | None:
    """The ALFWorld data root of a run: ``data``, else ``$ALFWORLD_DATA`` (the one place the
    variable is read for runs), else None (generated games)."""
    return cfg.gameset.data or os.environ.get("ALFWORLD_DATA") or None


# -- the command line ---------------------------------------------------------------------------
class KeyValue(argparse.Action):
    """``--backend-option KEY=VALUE`` (repeatable): values are read as YAML scalars."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        import yaml  # lazily: PyYAML costs ~25 ms; only reading or writing YAML needs it

        key, sep, raw = str(values).partition("=")
        if not sep or not key:
            parser.error(f"{option_string} takes KEY=VALUE, got {redact(str(values))!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            where = str(exc).splitlines()[0]
            raise ConfigError(
                f"{option_string} {key.strip()}: the value is not valid YAML ({where}): quote "
                f"it as text ({option_string} '{key.strip()}=\"...\"') or fix the brackets"
            ) from None
        current = dict(getattr(namespace, self.dest) or {})
        current[key.strip()] = value
        setattr(namespace, self.dest, current)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` flags, one per config leaf, grouped by section. Defaults are None, so only
    the flags given override a file or a resumed run."""
    parser.add_argument(
        "--config",
        help="YAML file of config keys, or a preset name (paper, scale, scale-cpu, ...): "
        "flags override it",
    )
    for section, section_type in section_types().items():
        doc = (section_type.__doc__ or "").strip()
        group = parser.add_argument_group(f"{section} ({section}: in YAML)", doc)
        hints = _hints(section)
        for f in dataclasses.fields(section_type):
            meta = f.metadata
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
            text = f"{help_text(meta)} (default: {default!r})"
            kw: dict[str, Any] = {"dest": f.name, "help": text, "default": None}
            if kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif kind is tuple:
                kw["action"] = "append" if meta["flag"] else "extend"
                if not meta["flag"]:
                    kw["nargs"] = "+"
            elif kind is dict:
                kw["action"] = KeyValue
                kw["metavar"] = "KEY=VALUE"
            else:
                kw["type"] = kind if kind in (int, float) else str
                if meta["choices"]:
                    kw["choices"] = _choices(meta)
            group.add_argument(flag, **kw)
    a = parser.add_argument
    a("--resume", metavar="DIR", help="continue the run in DIR")
    a("--force", action="store_true", help="resume even if the manifest does not match")
    a("--dry-run", action="store_true", help="print the resolved plan and exit")
    a("--verbose", action="store_true", help="print the whole resolved config at start")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config leaves given as flags."""
    known = leaves()
    return {k: v for k, v in vars(args).items() if k in known and v is not None}


def resolve(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge: defaults < base (e.g. a resumed manifest) < YAML file < flags given."""
    values: dict[str, Any] = flatten(dict(base or {}), "resumed run")
    source = getattr(args, "config", None) or "flags"
    given: dict[str, Any] = {}
    if getattr(args, "config", None):
        given.update(flatten(load_yaml(args.config), str(args.config)))
    given.update(flag_values(args))
    resume = getattr(args, "resume", None)
    if resume and given.get("run_dir") is not None and not _same_dir(given["run_dir"], resume):
        raise ConfigError(
            f"--resume {resume} continues the run in {resume}, not in run-dir "
            f"{given['run_dir']}: drop --run-dir (or give the same folder)"
        )
    return from_mapping({**values, **given}, source=source)


def _same_dir(a: Any, b: Any) -> bool:
    try:
        return Path(str(a)).resolve() == Path(str(b)).resolve()
    except (OSError, RuntimeError):
        return str(a) == str(b)


def parse_deadline(value: str | None, start: float) -> float | None:
    """Seconds since the epoch at which to stop, from '8h', '90m', '3600s', '3600' or ISO time."""
    if value is None:
        return None
    text = value.strip().lower()
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(
                f"bad deadline {value!r}: a wall time is a finite number >= 0 (8h, 90m, 3600s)"
            )
        return start + seconds

    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ConfigError(
            f"bad deadline {value!r}: use e.g. 8h, 90m, 3600s or an ISO time"
        ) from None
