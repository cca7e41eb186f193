"""The house rules of docs/architecture.md, checked on the source itself.

Imports are read with ``ast`` from every module under ``src/grimoire``, function-level ones
included, so a cycle cannot hide inside a function. The layer order itself is enforced by
``lint-imports`` (the contract in pyproject.toml); this test runs it too, so the README's test
command alone catches an import that runs back up.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "grimoire"

# Imports made inside a function on purpose (never to dodge a cycle): the package's lazy public
# names keep `import grimoire` and `grimoire --help` fast.
LAZY_BY_DESIGN = {"grimoire", "grimoire.cli.main"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(name: str) -> list[tuple[str, bool]]:
    """(imported grimoire module, at function level?) for every import in module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_nodes(tree)
    nested = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when one exists by that name.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for target in targets:
            if target.split(".")[0] == "grimoire" and target in MODULES and target != name:
                found.append((target, id(node) in nested))
    return found


GRAPH = {name: sorted({t for t, _ in imports_of(name)}) for name in MODULES}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in graph:
        if state.get(start):
            continue
        path, stack = [start], [iter(graph[start])]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(graph.get(nxt, [])))
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    # A test of the test: without this, a finder that never reports would pass below.
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None
    assert find_cycle({"a": ["a"]}) == ["a", "a"]


def test_no_import_cycle_inside_the_package():
    assert len(GRAPH) > 50  # the walk saw the package
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_function_level_import_of_a_grimoire_module():
    # A function-level import is how a cycle hides; the layers make every import a top one.
    hidden = [
        f"{name} imports {target} inside a function"
        for name in MODULES
        if name not in LAZY_BY_DESIGN
        for target, nested in imports_of(name)
        if nested
    ]
    assert hidden == []


def test_file_sizes_and_top_level_modules():
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert too_long == {}
    assert len((PACKAGE / "training" / "trainer.py").read_text().splitlines()) <= 400
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_import_linter_layers_contract_holds():
    # Run from the repository root so it reads pyproject.toml's contract; the working tree's
    # src goes first on the path, whatever copy of grimoire is installed.
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert exe, "import-linter is missing: pip install -e '.[dev]'"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
