"""No import cycles in the project: the module graph of agents, envs, memory and experiments (ast)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agents", "envs", "memory", "experiments")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.Module, import_time: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements; with ``import_time``, only those run when the module is imported (not
    inside functions); never those under ``if TYPE_CHECKING``."""

    def walk(nodes: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If) and _is_type_checking(node):
                yield from walk(node.orelse)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and import_time:
                continue
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    yield from walk(getattr(node, field, []))

    return walk(tree.body)


def targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads (the names it imports may be submodules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def graph(import_time: bool) -> dict[str, set[str]]:
    """module -> project modules it imports. For import time, importing ``a.b.c`` also runs the
    packages ``a`` and ``a.b`` (unless they are the importer's own parents, already running)."""
    modules = project_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        own_parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for node in import_nodes(tree, import_time):
            for name in targets(node, module, is_package):
                parts = name.split(".")
                loaded = (
                    [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                    if import_time
                    else [name]
                )
                for target in loaded:
                    if target in modules and target != module and target not in own_parents:
                        edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_project() -> None:
    edges = graph(import_time=False)
    assert {"experiments.store", "experiments.report", "memory.records"} <= set(edges)
    assert "memory.records" in edges["experiments.store"]
    assert "experiments.viewer.static" in edges["experiments.report"]  # a lazy import counts


def test_cycles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycles_at_import_time() -> None:
    """What runs when a module is imported, packages included: a cycle here can fail an import."""
    assert cycles(graph(import_time=True)) == []


def test_no_import_cycles_between_modules() -> None:
    """Every import, lazy ones included: modules depend on each other in one direction only."""
    assert cycles(graph(import_time=False)) == []


def test_model_backends_import_no_agent() -> None:
    """agents.llm is the layer below the agents: none of its modules imports an agents module
    outside agents.llm (lazy imports included)."""
    outside = {
        module: sorted(t for t in targets if t.startswith("agents.") and
                       not t.startswith("agents.llm"))
        for module, targets in graph(import_time=False).items()
        if module == "agents.llm" or module.startswith("agents.llm.")
    }  # fmt: skip
    assert "agents.llm.scripted" in outside
    assert {m: t for m, t in outside.items() if t} == {}


# Who may read a game's ground truth (its walkthrough): the port, and its privileged readers.
GROUND_TRUTH_READERS = {"agents.llm.ground_truth", "agents.llm.scripted", "agents.oracle"}


def test_only_the_privileged_readers_name_the_walkthrough() -> None:
    """Requests, agents, the trial loop and the runner never carry the ground truth: outside the
    port and its readers, agents, experiments and memory do not even name it."""
    named = [
        module
        for module, path in project_modules().items()
        if module.split(".")[0] in ("agents", "experiments", "memory")
        and module not in GROUND_TRUTH_READERS
        and "walkthrough" in path.read_text().lower()
    ]
    assert named == []


# What builds prompts: only agents/ may call these (experiments/ plays agents, it writes no text).
PROMPT_BUILDERS = {
    "actor_prompt", "actor_prefix", "reflection_prompt", "judge_prompt", "render_transcript",
    "example_texts", "memory_block", "template",
}  # fmt: skip


def test_experiments_build_no_prompts() -> None:
    for module, path in project_modules().items():
        if not module.startswith("experiments"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agents"):
                used = {a.name for a in node.names} & PROMPT_BUILDERS
                assert not used, f"{module} imports prompt builders {sorted(used)}"
            if isinstance(node, ast.Attribute) and node.attr in PROMPT_BUILDERS:
                assert not isinstance(node.value, ast.Name) or node.value.id not in (
                    "prompting", "reflexion", "react",
                ), f"{module} calls {node.attr}"  # fmt: skip


def arm_names() -> set[str]:
    from agents import arms

    return set(arms.names())


def _names_an_arm(node: ast.AST, names: set[str]) -> bool:
    """A string constant (or a tuple, list or set of them) that is an arm's name."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_an_arm(e, names) for e in node.elts)
    return False


def _is_purpose(node: ast.AST) -> bool:
    """``request.purpose`` (or a ``purpose`` name): a request's purpose ("plan") is no arm."""
    return (isinstance(node, ast.Attribute) and node.attr == "purpose") or (
        isinstance(node, ast.Name) and node.id == "purpose"
    )


def arm_branches(source: str, names: set[str]) -> list[int]:
    """Lines where code branches on an arm's name: a comparison, a ``case`` or a dict key."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_purpose(n) for n in operands):
                continue
            if any(_names_an_arm(n, names) for n in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_an_arm(node.value, names):
            lines.append(node.value.lineno)
        elif isinstance(node, ast.Dict) and any(
            k is not None and _names_an_arm(k, names) for k in node.keys
        ):
            lines.append(node.lineno)
    return lines


def test_the_arm_check_finds_a_branch() -> None:
    names = arm_names()
    code = 'if arm in ("plan", "x"):\n    pass\nmatch a:\n    case "lats":\n        pass\n'
    assert arm_branches(code, names) == [1, 4]
    assert arm_branches('if request.purpose == "plan":\n    pass\n', names) == []
    assert arm_branches('agent = option("reflexion", "arm: react or lats")\n', names) == []


def test_experiments_name_no_arm() -> None:
    """The runner builds an arm through the registry (agents.arms): no code under experiments/
    branches on an arm's name (presets and results are data, not code)."""
    names = arm_names()
    found = {
        module: lines
        for module, path in project_modules().items()
        if module.startswith("experiments") and (lines := arm_branches(path.read_text(), names))
    }
    assert found == {}
