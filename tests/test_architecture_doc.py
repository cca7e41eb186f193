"""docs/architecture.md checked against the code it describes: its layer list against
pyproject.toml's import-linter contract, its set-up order against the trainer's build steps,
its stage and folder tables against ``src/grimoire`` (every folder listed, every file a row
names there)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "grimoire"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def section(title: str) -> str:
    """The text of the ``## title`` section of the page."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOC, re.M | re.S)
    assert match, f"docs/architecture.md has no '## {title}' section"
    return match.group(1)


def module_of(name: str) -> str:
    """``cli/`` or ``train.py`` as written on the page -> ``grimoire.cli`` / ``grimoire.train``."""
    return "grimoire." + name.removesuffix("/").removesuffix(".py")


# ---------------------------------------------------------------------------- the layers


def documented_layers() -> list[set[str]]:
    block = re.search(r"```text\n(.*?)```", section("The one-way rule"), re.S)
    assert block, "the one-way rule has no ```text block of layers"
    layers = []
    for line in block.group(1).splitlines():
        names = re.split(r"\s+\|\s+", re.split(r"\s{2,}", line.strip())[0])
        layers.append({module_of(n) for n in names})
    return layers


def contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [{m.strip() for m in layer.split("|")} for layer in contract["layers"]]


def test_layer_list_is_the_import_linter_contract():
    assert documented_layers() == contract_layers()


# ---------------------------------------------------------------------------- set-up order


def calls_in_order(fn: ast.FunctionDef) -> list[str]:
    """Names of the functions and methods ``fn`` calls, in source order."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    names = []
    for call in calls:
        if isinstance(call.func, ast.Attribute):
            names.append(call.func.attr)
        elif isinstance(call.func, ast.Name):
            names.append(call.func.id)
    return names


def function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    scope = tree.body
    if cls is not None:
        (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        scope = klass.body
    (fn,) = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def documented_steps() -> list[str]:
    """The numbered list of build steps: the first backticked name of each item."""
    items = re.findall(r"^\d+\. `(\w+)`", section("Set-up as build steps"), re.M)
    assert items, "the set-up section has no numbered list of `build_step` names"
    return items


def test_setup_order_is_the_trainers_build_steps():
    setup_py = PACKAGE / "training" / "setup.py"
    steps = {n.name for n in ast.parse(setup_py.read_text()).body if isinstance(n, ast.FunctionDef)}
    # Two steps live in model/ (the checkpointing decision, torch_compile); `_loader` is the
    # trainer's wrapper of setup.build_loader, shared with evaluation.
    steps |= {"resolve_checkpointing", "maybe_compile"}
    init = function(PACKAGE / "training" / "trainer.py", "__init__", "GrimoireTrainer")
    called = [
        "build_loader" if name == "_loader" else name
        for name in calls_in_order(init)
        if name in steps or name == "_loader"
    ]
    assert called == documented_steps()


def test_model_preparation_order_is_prepare_models():
    text = section("Set-up as build steps")
    item = re.search(r"^\d+\. `prepare_model`[^\n]*(?:\n   [^\n]*)*", text, re.M)
    assert item, "the set-up list has no `prepare_model` item"
    documented = re.findall(r"`(\w+)`", item.group(0))[1:]
    fn = function(PACKAGE / "training" / "setup.py", "prepare_model")
    tree = ast.parse((PACKAGE / "training" / "setup.py").read_text())
    from_model = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grimoire.model")
        for alias in node.names
    }
    # resolve_checkpointing runs in prepare_model only when it is called on its own; the trainer
    # decides first, as its own step (above).
    pieces = from_model - {"resolve_checkpointing"} | {"get_peft_model"}
    assert [n for n in calls_in_order(fn) if n in pieces] == documented


# ---------------------------------------------------------------------------- the folders


def table_rows(title: str) -> list[tuple[str, str]]:
    """``(folder, description)`` of every table row of section ``title`` that names a folder
    (a cell like `` `rows/` ``) or the package's top level."""
    rows = []
    for line in section(title).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| "):
            continue
        folder = next((c for c in cells if re.fullmatch(r"`\w+/`|top level", c)), None)
        if folder is not None:
            rows.append((folder.strip("`"), cells[-1]))
    return rows


#: Files the page describes that another branch of the same change adds; this list is emptied
#: when it is merged.
PENDING_OTHER_BRANCHES: set[str] = set()


def test_every_folder_of_the_package_is_in_the_stage_tables():
    documented = {cell for cell, _ in table_rows("The stages and their folders")}
    folders = {f"{p.parent.name}/" for p in PACKAGE.glob("*/__init__.py")}
    assert documented == folders | {"top level"}


def test_every_file_a_table_row_names_exists():
    """A name is looked for in the row's folder, then from the package root, then from the
    repository root (a test the row cites)."""
    missing = []
    for cell, text in table_rows("The stages and their folders"):
        folder = PACKAGE / cell if cell.endswith("/") else PACKAGE
        for name in re.findall(r"`([\w/]+\.py)`", text):
            if not any((base / name).is_file() for base in (folder, PACKAGE, ROOT)):
                missing.append(f"{cell}{name}" if cell.endswith("/") else name)
    assert set(missing) == PENDING_OTHER_BRANCHES - {
        p for p in PENDING_OTHER_BRANCHES if (PACKAGE / p).is_file()
    }
    stale = sorted(p for p in PENDING_OTHER_BRANCHES if (PACKAGE / p).is_file())
    assert stale == [], f"these exist now: drop them from PENDING_OTHER_BRANCHES: {stale}"
