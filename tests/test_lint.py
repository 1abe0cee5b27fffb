"""Static checks wired into the test command: ruff (lint + format), mypy, and the import rules."""

import ast
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agents", "envs", "memory", "experiments")
HEAVY = {
    "vllm",
    "openai",
    "anthropic",
    "transformers",
    "torch",
    "llama_cpp",
    "alfworld",
    "textworld",
}


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_lint():
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_format():
    r = _run("ruff", "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy():
    pytest.importorskip("mypy")
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_top_level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top))
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_import_direction():
    allowed = {
        "memory": set(),
        "envs": {"envs", "memory"},  # memory: the standard-library records every package shares
        "agents": {"agents", "memory"},
        "experiments": set(PACKAGES),
    }
    for package in PACKAGES:
        for f in _files(package):
            for module, _ in _imports(f):
                root = module.split(".")[0]
                if root in PACKAGES:
                    assert root in allowed[package] | {package}, (
                        f"{f.relative_to(ROOT)} imports {module}"
                    )


def test_memory_uses_only_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    for f in _files("memory"):
        for module, _ in _imports(f):
            root = module.split(".")[0]
            assert root in stdlib or root == "memory", f"{f.relative_to(ROOT)} imports {module}"


def test_heavy_libraries_are_imported_lazily():
    for package in PACKAGES:
        for f in _files(package):
            for module, top in _imports(f):
                if module.split(".")[0] in HEAVY:
                    assert not top, f"{f.relative_to(ROOT)} imports {module} at module level"


def test_light_imports():
    heavy = sorted(HEAVY)
    code = f"import sys, envs, agents, agents.llm, memory; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def _unexplained_inner_imports(path: Path) -> list[int]:
    """Lines of imports inside functions with no comment saying why they are not at the top: on
    the statement's lines, on the line directly above, or above the run of imports it ends."""
    text = path.read_text()
    with path.open("rb") as fh:
        comments = {
            t.start[0] for t in tokenize.tokenize(fh.readline) if t.type == tokenize.COMMENT
        }
    inner = sorted(
        {
            (n.lineno, n.end_lineno or n.lineno)
            for f in ast.walk(ast.parse(text))
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)
            if isinstance(n, ast.Import | ast.ImportFrom)
        }
    )
    explained: set[int] = set()  # end lines of explained imports, for the next one in a run
    missing = []
    for first, last in inner:
        said = any(line in comments for line in range(first - 1, last + 1))
        if said or first - 1 in explained:
            explained.add(last)
        else:
            missing.append(first)
    return missing


def test_imports_inside_functions_say_why():
    """An import that is not at the top of its file carries a comment saying why (a heavy
    optional library, a cycle, start-up time)."""
    for package in PACKAGES:
        for f in _files(package):
            missing = _unexplained_inner_imports(f)
            assert not missing, (
                f"{f.relative_to(ROOT)}:{missing[0]} imports inside a function with no comment why"
            )


def _sys_attrs(tree: ast.AST, name: str) -> list[ast.Attribute]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == name
        and isinstance(n.value, ast.Name)
        and n.value.id == "sys"
    ]


def test_library_code_never_exits_or_reads_argv():
    for package in PACKAGES:
        for f in _files(package):
            if f.name == "cli.py":
                continue
            tree = ast.parse(f.read_text())
            assert not _sys_attrs(tree, "exit"), f"{f.relative_to(ROOT)} calls sys.exit"
            argv = _sys_attrs(tree, "argv")
            # saving and restoring argv around a third-party import is allowed; reading it is not
            guarded = any(
                ast.unparse(t).startswith("sys.argv")
                for n in ast.walk(tree)
                if isinstance(n, ast.Assign)
                for t in n.targets
            )
            assert not argv or guarded, f"{f.relative_to(ROOT)} reads sys.argv"
