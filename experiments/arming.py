"""The arm a run plays, built from its config: the actor's, the reflection's and the trial loop's
settings, the prompt files the user gave, the models of their own an arm asks for, and the agent
made by the arm's registered factory (:mod:`agents.arms`).

Settings take the config's names: a settings field built from a config leaf has the leaf's name,
and an arm's own options reach its factory as its config section (``ArmContext.settings``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agents import arms
from agents.arm import ArmContext, SearchLog
from agents.episode import Agent
from agents.evaluators import make_evaluator
from agents.layout import REACT, PromptLayout
from agents.llm import make_backend, parse_spec
from agents.llm.base import Backend, GenerationConfig
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.llm.vllm_backend import DEFAULT_GPU_MEMORY_UTILIZATION
from agents.parsing import GroundingRules
from agents.prompting import PromptFileError, file_sha256, load_original_prompts, sha256
from agents.react import ActorSettings
from agents.reflexion import ReflexionSettings
from agents.reflexion_code import CODE_PROTOCOL, CodeLayout, CodePrompts, layout_text, read_wording
from experiments.config import RunConfig, role_options_of
from experiments.errors import ConfigError
from experiments.prompts import layout_class
from experiments.trials import Safeguards, Task, TrialPlan

# The reflexion-code protocol's wording files, by config key.
CODE_FILES = ("prompts", "instruction_file", "reflection_template", "reflection_examples")


def generation_config(cfg: RunConfig) -> GenerationConfig:
    """How the actor samples (one line per step)."""
    m = cfg.models
    return GenerationConfig(
        temperature=m.temperature, top_p=m.top_p, max_tokens=m.max_tokens, stop=("\n",),
        seed=cfg.protocol.seed,
    )  # fmt: skip


def backend_options(cfg: RunConfig, role: str = "actor") -> dict[str, Any]:
    """The keyword options ``role``'s model backend is made with: the run's, then the role's own."""
    options = dict(cfg.models.backend_options)
    if cfg.models.base_url:
        options["base_url"] = cfg.models.base_url
    if cfg.models.chat_format:
        options["chat_format"] = cfg.models.chat_format
    options.update(role_options_of(cfg.models.role_options, role))
    spec = own_models(cfg).get(role, cfg.models.model)
    if options.get("base_url") and parse_spec(spec).kind in ("openai", "vllm"):
        # a server of the user's (or --serve's): as many requests in flight as the run has
        # episodes (the client's own default, 8, would cap a GPU's batch at 8)
        options.setdefault("concurrency", max(cfg.execution.concurrency, 8))
    sent_first = layout_class(cfg.protocol.protocol).chat_instruction
    if sent_first is not None and role == "actor":  # the layout's, unless the user set one
        options.setdefault("chat_instruction", sent_first)
    return options


def arm_roles(cfg: RunConfig) -> dict[str, str | None]:
    """The arm's own model roles and the specs its config section names (None: the actor's)."""
    arm = arms.get(cfg.protocol.agent)
    section = cfg.section(arm.section) if arm.section else None
    return {r.name: getattr(section, r.key) for r in arm.roles}


def own_models(cfg: RunConfig) -> dict[str, str]:
    """The roles with a backend of their own, and their specs: the actor, and each other role
    (the reflector, the arm's own, escalation) that names another model or has options of its
    own (the rest share the actor's)."""
    specs = {
        "reflect": cfg.models.reflector,
        **arm_roles(cfg),
        "escalate": cfg.safeguards.escalate_model,
    }
    own = {"actor": cfg.models.model}
    for role, spec in specs.items():
        if spec and (spec != cfg.models.model or role_options_of(cfg.models.role_options, role)):
            own[role] = spec
    return own


def check_device_share(cfg: RunConfig) -> None:
    """Refuse a run whose in-process vLLM models ask for more than the whole device memory
    (``gpu_memory_utilization`` summed over the models with an engine of their own)."""
    parts: list[tuple[float, str]] = []
    key = "gpu_memory_utilization"
    for role, spec in own_models(cfg).items():
        options = backend_options(cfg, role)
        if parse_spec(spec).kind != "vllm" or options.get("base_url") or cfg.server.serve:
            continue
        if key in role_options_of(cfg.models.role_options, role):
            where = f"role_options {role}.{key}"
        elif key in cfg.models.backend_options:
            where = f"backend_options {key} ({role})"
        else:
            where = f"{role}'s default {key}"
        try:
            parts.append((float(options.get(key, DEFAULT_GPU_MEMORY_UTILIZATION)), where))
        except (TypeError, ValueError):
            continue  # the backend names a bad value itself
    total = sum(share for share, _ in parts)
    if len(parts) > 1 and total > 1.0 + 1e-9:
        named = ", ".join(f"{where}={share:g}" for share, where in parts)
        raise ConfigError(
            f"the in-process vLLM models ask for more than the whole device: {named} add up to "
            f"{total:g} > 1.0; set each role's share with "
            "--role-option ROLE.gpu_memory_utilization=FRACTION"
        )


def code_prompts(cfg: RunConfig) -> CodePrompts | None:
    """The user's files of the reflexion-code protocol (None in reflexsim's own)."""
    p = cfg.protocol
    if p.protocol != CODE_PROTOCOL:
        return None
    if cfg.models.action_decoding != "free":
        raise ConfigError(
            f"--protocol {CODE_PROTOCOL} takes the model's text as the code does: "
            f"--action-decoding free, not {cfg.models.action_decoding}"
        )
    missing = [n for n in CODE_FILES if not getattr(p, n)]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise ConfigError(f"--protocol {CODE_PROTOCOL} needs the wording files: {flags}")
    assert p.prompts and p.instruction_file and p.reflection_template and p.reflection_examples
    try:
        return CodePrompts.load(
            p.prompts, p.instruction_file, p.reflection_template, p.reflection_examples
        )
    except PromptFileError as exc:
        raise ConfigError(str(exc)) from None


def prompt_file_hashes(cfg: RunConfig) -> dict[str, str]:
    """sha256 of every prompt file the user gave (and of the protocol's layout file)."""
    p = cfg.protocol
    out = {n: file_sha256(getattr(p, n)) for n in CODE_FILES if getattr(p, n)}
    if p.protocol == CODE_PROTOCOL:
        out["layout"] = sha256(layout_text())
    return out


def instruction(cfg: RunConfig) -> str | None:
    """The text of ``instruction_file`` (None without one)."""
    path = cfg.protocol.instruction_file
    if path is None:
        return None
    try:
        return read_wording(path, "instruction file")
    except PromptFileError as exc:
        raise ConfigError(str(exc)) from None


def check_prompts_file(cfg: RunConfig, tasks: Sequence[Task]) -> None:
    """The ``prompts`` file read whole, with a pair of examples for every task type of ``tasks``:
    a bad file is one line now, not a crash once the run is under way."""
    if not cfg.protocol.prompts:
        return
    try:
        load_original_prompts(cfg.protocol.prompts, sorted({t.task_type for t in tasks}))
    except PromptFileError as exc:
        raise ConfigError(f"--prompts: {exc}") from None


def prompt_layout(cfg: RunConfig) -> PromptLayout:
    """The run's prompt layout, with the user's wording files it needs (read now)."""
    files = code_prompts(cfg)
    if files is None:
        return REACT
    return CodeLayout(files, code_put_to_move=cfg.protocol.code_put_to_move)


def reflexion_settings(cfg: RunConfig, layout: PromptLayout | None = None) -> ReflexionSettings:
    """(``layout``: the run's, when already made.)"""
    p, guards = cfg.protocol, cfg.safeguards
    return ReflexionSettings(
        memory_size=p.memory_size,
        reflect_model=cfg.models.reflector,
        reflect_max_tokens=cfg.models.reflect_max_tokens,
        prompts=p.prompts,
        seed=p.seed,
        reflection_format=guards.reflection_format,
        reflection_max_chars=guards.reflection_max_chars,
        layout=layout or prompt_layout(cfg),
        instruction=instruction(cfg),
    )


def trial_plan_of(cfg: RunConfig, layout: PromptLayout | None = None) -> TrialPlan:
    """How many trials, the arm's memory and reflection settings, and the safeguards."""
    guards = cfg.safeguards
    return TrialPlan(
        trials=cfg.protocol.trials,
        reflexion=reflexion_settings(cfg, layout),
        memory=arms.get(cfg.protocol.agent).memory,
        llm_judge=cfg.evaluation.evaluator == "llm",
        safeguards=Safeguards(
            task_max_tokens=guards.task_max_tokens,
            task_max_seconds=guards.task_max_seconds,
            oscillation_stop=guards.oscillation_stop,
            escalate_model=guards.escalate_model,
        ),
    )


def grounding_rules(cfg: RunConfig) -> GroundingRules:
    """The rewrites of the model's action: none in the reflexion-code protocol (its one asked-for
    rewrite is ``code_put_to_move``); put X in/on Y -> move X to Y is ALFWorld 0.4's syntax
    (TextWorld keeps `put`)."""
    if cfg.protocol.protocol == CODE_PROTOCOL or not cfg.protocol.grounding:
        return GroundingRules.none()
    return GroundingRules(put_to_move=cfg.gameset.env == "alfworld")


def actor_settings(cfg: RunConfig, layout: PromptLayout | None = None) -> ActorSettings:
    """(``layout``: the run's, when already made.)"""
    p, e = cfg.protocol, cfg.evaluation
    return ActorSettings(
        generation=generation_config(cfg),
        evaluator=make_evaluator(
            e.evaluator,
            count_thoughts=p.count_thoughts,
            max_actions=e.max_actions,
            max_repeats=e.max_repeats,
            exact=p.protocol == CODE_PROTOCOL,
        ),  # fmt: skip
        grounding=grounding_rules(cfg),
        max_steps=p.max_steps,
        count_thoughts=p.count_thoughts,
        action_decoding=cfg.models.action_decoding,
        layout=layout or prompt_layout(cfg),
    )


def routes(cfg: RunConfig) -> dict[str, str]:
    """The request purposes the arm's own roles answer, and each one's role."""
    return {p: r.name for r in arms.get(cfg.protocol.agent).roles for p in r.purposes}


def build_agent(
    cfg: RunConfig,
    log: SearchLog | None = None,
    truth: GroundTruth = NO_GROUND_TRUTH,
    layout: PromptLayout | None = None,
) -> Agent:
    """The arm's agent, built by its registered factory from its own config section (a search
    agent's tree goes to ``log``; ``truth``: the games' solutions, for the arms whose value
    function may read them; ``layout``: the run's, when already made)."""
    arm = arms.get(cfg.protocol.agent)
    settings = cfg.section(arm.section) if arm.section else None
    layout = layout or prompt_layout(cfg)
    context = ArmContext(
        actor_settings(cfg, layout), reflexion_settings(cfg, layout), settings, log, truth
    )
    return arm.build(context)


def extra_backends(cfg: RunConfig, truth: GroundTruth = NO_GROUND_TRUTH) -> dict[str, Backend]:
    """The arm's own roles' and escalation's models, when they are models of their own (built
    with the actor, so a bad spec or a missing API key is refused before the run directory is
    written)."""
    out: dict[str, Backend] = {}
    own = own_models(cfg)
    try:
        for role in (*arm_roles(cfg), "escalate"):
            if role in own:
                out[role] = make_backend(
                    own[role], ground_truth=truth, **backend_options(cfg, role)
                )
    except BaseException:
        for backend in out.values():
            backend.close()
        raise
    return out
