"""The house rules of docs/architecture.md, checked on the source itself.

Imports are read with ``ast`` from every module under ``src/grimoire``, function-level ones
included, so a cycle cannot hide inside a function. The layer order itself is enforced by
``lint-imports`` (the contract in pyproject.toml); this test runs it too, so the README's test
command alone catches an import that runs back up.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import tomllib

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


# ---------------------------------------------------------------------------- function length

#: The longest a function may be: its lines from the ``def`` line (decorators not counted) to
#: its last line, blank and comment lines included, its docstring excluded. A nested function
#: counts on its own and inside its parent.
MAX_FUNCTION_LINES = 60

#: Functions allowed to be longer, each with why.
LONG_BY_DESIGN: dict[str, str] = {}

#: Long functions in files another branch of the same change is rewriting; that branch splits
#: them, and this list is emptied when it is merged.
PENDING_OTHER_BRANCHES: set[str] = set()


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """``fn``'s length as :data:`MAX_FUNCTION_LINES` counts it."""
    lines = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
    first = fn.body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return lines


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"folder/module.py::name": lines}`` of every function in src/grimoire over ``limit``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = function_lines(node)
                if n > limit:
                    found[f"{path.relative_to(PACKAGE).as_posix()}::{node.name}"] = n
    return found


def test_function_length_counts_def_to_end_without_the_docstring():
    # A test of the counter: 1 def line + a 3-line docstring + 2 comment/blank + 3 code lines.
    source = (
        'def f(x):\n    """One.\n\n    Two."""\n    # why\n\n    y = x\n    z = y\n    return z\n'
    )
    fn = ast.parse(source).body[0]
    assert isinstance(fn, ast.FunctionDef) and function_lines(fn) == 6


def test_no_function_over_60_lines():
    found = long_functions()
    assert len(found) >= len(PENDING_OTHER_BRANCHES) or not PENDING_OTHER_BRANCHES
    over = {k: n for k, n in found.items() if k not in set(LONG_BY_DESIGN) | PENDING_OTHER_BRANCHES}
    assert over == {}, (
        f"functions over {MAX_FUNCTION_LINES} lines (def to end, docstring excluded): split "
        f"them into named helpers: {over}"
    )
    stale = sorted((set(LONG_BY_DESIGN) | PENDING_OTHER_BRANCHES) - set(found))
    assert stale == [], f"no longer over {MAX_FUNCTION_LINES} lines, drop from the lists: {stale}"


# ---------------------------------------------------------------------------- history comments

#: What tells the work's history instead of the code: issue and PR numbers, who or which session
#: wrote a line, what the code "used to" do. Matched in comments and docstrings only.
HISTORY = re.compile(
    r"\b(issue|PR|pull request|ticket)\s*#?\d+"
    r"|(?<![\w&/])#\d+\b"
    r"|\bsessions?\b"
    r"|\b(added|written|wrote|changed|fixed) by (a |the )?(session|developer|newcomer|reviewer|lead)\b"
    r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bwere )\bused to\b",
    re.IGNORECASE,
)


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every module, class and function docstring."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                found.append((node.body[0].lineno, doc))
    return found


def history_lines(source: str) -> list[str]:
    return [
        f"{line}: {m.group(0)!r}"
        for line, text in comments_and_docstrings(source)
        for m in HISTORY.finditer(text)
    ]


def test_the_history_finder_finds_planted_history_and_nothing_else():
    planted = (
        '"""Module (issue #16: measured there)."""\n'
        "x = 1  # see #34\n"
        "def f():\n"
        '    """Written in the session that had no GPU."""\n'
        "    # the loss used to be summed here; added by the lead\n"
        "    return '#222'  # a colour in a string is code, not a comment\n"
    )
    assert len(history_lines(planted)) == 5
    clean = (
        "# the reference is used to score; numbers are used to size it\n"
        "# the NLL part is added by the loss class; colours #1f77b4\n"
    )
    assert history_lines(clean) == []


def test_no_comment_tells_the_work_history():
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted(PACKAGE.rglob("*.py"))
        if (hits := history_lines(p.read_text()))
    }
    assert found == {}, f"comments about the work's history, not the code: {found}"


# ---------------------------------------------------------------------------- compat at the edge

#: Where grimoire.compat may be imported from: the entry points, the modules at grimoire-rl's
#: import paths, and compat itself.
COMPAT_IMPORTERS = ("grimoire.cli", "grimoire.tools", "grimoire.data", "grimoire.compat")
COMPAT_IMPORTER_MODULES = {"grimoire.registry", "grimoire.train", "grimoire.__main__"}

#: Core modules allowed to import compat, each with why; pyproject.toml's contracts ignore the
#: same imports.
CORE_COMPAT_IMPORTS: dict[str, str] = {
    "grimoire.losses.online -> grimoire.compat.grimoire_rl_methods": (
        "grimoire-rl's users build the online methods in Python with its constructor spelling; "
        "no entry point stands between them and the constructor"
    ),
}


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_core_never_imports_compat():
    found = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if not _in(name, COMPAT_IMPORTERS) and name not in COMPAT_IMPORTER_MODULES
        for target in targets
        if _in(target, ("grimoire.compat",))
    }
    assert found == set(CORE_COMPAT_IMPORTS), (
        "grimoire.compat is for the entry points and grimoire-rl's module paths only; "
        f"unexpected: {sorted(found - set(CORE_COMPAT_IMPORTS))}, "
        f"no longer made: {sorted(set(CORE_COMPAT_IMPORTS) - found)}"
    )
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if "containers" in contract:  # one folder's own layers: compat is no part of them
            continue
        assert set(contract.get("ignore_imports", [])) == set(CORE_COMPAT_IMPORTS), contract["name"]


def test_the_losses_never_call_back_into_the_rollouts_batches():
    # docs/architecture.md, "The online step": the stage builds, packs and hands over the
    # training batches; a method selects rows of them and scores them with forward/'s log-probs.
    back = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _in(name, ("grimoire.losses",))
        for target in targets
        if target == "grimoire.rollout.batches"
    }
    assert back == set()


# ---------------------------------------------------------------------------- short-name tables

#: A ``package.module:Name`` spec, as config/registry.py's tables hold them.
SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

#: Short-name tables allowed outside config/registry.py, each with why.
TABLES_ELSEWHERE: dict[str, str] = {
    "cli/main.py::TOOL_COMMANDS": "the CLI's own subcommands; no config names them",
}


def short_name_tables(source: str) -> list[str]:
    """Module-level dicts of ``source`` from string keys to ``package.module:Name`` specs or to
    classes and functions (defined or imported there): the shape of a short-name registry."""
    tree = ast.parse(source)
    bound = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    bound |= {
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(value, ast.Dict) or not value.keys:
            continue
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
            continue
        specs = all(
            isinstance(v, ast.Constant) and isinstance(v.value, str) and SPEC.fullmatch(v.value)
            for v in value.values
        )
        objects = all(isinstance(v, ast.Name) and v.id in bound for v in value.values)
        if specs or objects:
            found.append(ast.unparse(target))
    return found


def test_the_table_finder_finds_planted_tables():
    # A test of the test: both shapes found, other dicts left alone.
    planted = (
        "from m import Engine\n"
        "class Other: ...\n"
        "A = {'x': 'pkg.mod:Name', 'y': 'pkg:Outer.Inner'}\n"
        "B: dict = {'hf': Engine, 'other': Other}\n"
        "C = {'x': 1, 'y': True}\n"
        "D = {'x': 'no spec here'}\n"
        "E = {1: Engine}\n"
    )
    assert short_name_tables(planted) == ["A", "B"]


def test_every_short_name_table_lives_in_config_registry():
    elsewhere = {
        f"{path.relative_to(PACKAGE).as_posix()}::{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "config" / "registry.py"
        for name in short_name_tables(path.read_text())
    }
    assert elsewhere == set(TABLES_ELSEWHERE), (
        "short-name tables belong in config/registry.py (as 'package.module:Name' specs): "
        f"{sorted(elsewhere - set(TABLES_ELSEWHERE))}"
    )


def test_the_method_contract_imports_only_the_context():
    # docs/architecture.md: the protocol sits at the bottom of the layers and knows no layout.
    assert GRAPH["grimoire.contract.method"] == ["grimoire.config.context"]
