"""docs/architecture.md checked against the code it describes: its layer list against
pyproject.toml's import-linter contract, its set-up order against the trainer's build steps,
its stage and folder tables against ``src/grimoire`` both ways (every folder listed, every file
named by its folder's row, every file a row names there), and the claims it makes about where
the code branches on a batch's layout."""

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
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and "containers" not in c
    ]
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


def row_of(path: Path) -> str:
    """The table cell that must name ``path`` (a file under src/grimoire): its top folder's row
    (`` rows/ ``), or ``top level``."""
    parts = path.relative_to(PACKAGE).parts
    return f"{parts[0]}/" if len(parts) > 1 else "top level"


def named_by_own_row(rows: list[tuple[str, str]]) -> set[Path]:
    """The files of src/grimoire that their own folder's row names: a name (`` `sft.py` ``,
    `` `head/function.py` ``, `` `config/model_shape.py` ``) is looked for in the row's folder,
    then from the package root, and counts for the row of the folder that holds the file."""
    named = set()
    for cell, text in rows:
        folder = PACKAGE / cell if cell.endswith("/") else PACKAGE
        for name in re.findall(r"`([\w/]+\.py)`", text):
            found = next((b / name for b in (folder, PACKAGE) if (b / name).is_file()), None)
            if found is not None and row_of(found) == cell:
                named.add(found)
    return named


def only_reexports(path: Path) -> bool:
    """True for a module that only imports and lists names (docstring, imports, ``__all__``):
    a package's ``__init__.py`` of that kind is stood for by its folder's row."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else []
        if [ast.unparse(t) for t in targets] == ["__all__"]:
            continue
        return False
    return True


def files_to_describe() -> set[Path]:
    """Every .py file under src/grimoire but the packages' re-exporting ``__init__.py``."""
    return {
        p
        for p in PACKAGE.rglob("*.py")
        if not (p.name == "__init__.py" and p.parent != PACKAGE and only_reexports(p))
    }


def test_only_reexports_tells_a_facade_from_code(tmp_path):
    # A test of the test: an __init__.py that defines anything must be named by its row.
    facade = tmp_path / "facade.py"
    facade.write_text('"""Doc."""\nfrom a import b\n\n__all__ = ["b"]\n')
    code = tmp_path / "code.py"
    code.write_text('"""Doc."""\nfrom a import b\n\nLIMIT = 3\n')
    assert only_reexports(facade) and not only_reexports(code)


def test_every_file_of_the_package_is_named_by_its_folders_row():
    rows = table_rows("The stages and their folders")
    unnamed = sorted(
        p.relative_to(PACKAGE).as_posix() for p in files_to_describe() - named_by_own_row(rows)
    )
    assert unnamed == [], (
        "docs/architecture.md names no row for these files: add each to its folder's row "
        f"(what it holds, in a few words): {unnamed}"
    )
    # A test of the test: a row names only what it lists, and only files of its own folder.
    one_row = named_by_own_row([("losses/", "`sft.py`, `config/context.py`, `gone.py`")])
    assert one_row == {PACKAGE / "losses" / "sft.py"}


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


# ---------------------------------------------------------------------------- layout kinds


def asks_layout_kind(source: str) -> bool:
    """True when ``source`` calls ``isinstance`` with ``Packed`` or ``Padded`` as the type."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
            kinds = node.args[1] if len(node.args) > 1 else None
            if kinds is not None and {"Packed", "Padded"} & {
                n.id for n in ast.walk(kinds) if isinstance(n, ast.Name)
            }:
                return True
    return False


def test_the_modules_that_ask_a_layouts_kind_are_the_ones_the_page_names():
    assert asks_layout_kind("if isinstance(layout, Padded | Packed): pass")
    assert not asks_layout_kind("if isinstance(layout, dict): Packed()")
    text = re.search(r"Which kind a layout is .*?checks that list", DOC, re.S)
    assert text, "the collator row no longer says where a layout's kind is asked"
    names = re.findall(r"`(\w+/\w+\.py)`", text.group(0))
    documented = {n for n in names if not n.startswith("tests/")}
    asking = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if asks_layout_kind(p.read_text())
    }
    assert asking == documented
