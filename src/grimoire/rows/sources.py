"""Dataset sources for configs and scripts: ``load_source`` and ``tokenize_dataset``.

A *source section* (the YAML ``dataset:`` / ``eval_dataset:`` mapping, minus ``tokenize``) names
exactly one of:

- ``name``: a Hugging Face hub dataset, with ``split`` (default ``"train"``) and optionally
  ``subset`` (alias ``config``). Needs network access unless the dataset is already in the local
  HF cache; offline, save a copy with ``Dataset.save_to_disk`` and use ``load_from_disk``.
- ``jsonl``: a local JSON-lines file (one object per line; a ``.json`` file may also hold one JSON
  array of objects).
- ``load_from_disk``: a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
  for a ``DatasetDict`` the ``split`` (default ``"train"``) is picked.
- ``path`` (grimoire-rl's key): a folder is read with ``load_from_disk``; a file ending in
  ``.jsonl`` / ``.json`` as ``jsonl``.

Optional: ``max_samples`` (keep the first N rows) after ``shuffle: true`` (seeded by ``seed``,
default 42). Relative paths resolve against the current working directory; ``grimoire://REL``
points inside the installed package (``grimoire://assets/reverse_train.jsonl``), so bundled
configs work from any folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grimoire.columns import listed
from grimoire.errors import ConfigError, DataError, did_you_mean
from grimoire.rows.common import counting_cuts, log_cuts, log_format

#: Prefix for files shipped inside the grimoire package.
PACKAGE_PREFIX = "grimoire://"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent

#: Keys a source section may hold, with their expected Python types.
SOURCE_KEYS: dict[str, type] = {
    "name": str,
    "split": str,
    "subset": str,
    "config": str,
    "jsonl": str,
    "path": str,
    "load_from_disk": str,
    "max_samples": int,
    "shuffle": bool,
    "seed": int,
}
_KINDS = ("name", "jsonl", "path", "load_from_disk")


#: Environment variables that put the Hugging Face libraries offline.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
#: A column :func:`read_source` carries through shuffle/max_samples and then removes: each row's
#: line in its JSONL file, so row problems can name ``file:line``.
_LINE_COLUMN = "__grimoire_source_line__"


def hub_offline() -> bool:
    """True when an environment variable puts the Hugging Face hub offline."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in OFFLINE_VARS)


def hub_dataset_cached(name: str) -> bool:
    """True when some local cache may hold hub dataset ``name`` (a loose check: a false "yes"
    only defers the error to loading, a false "no" would block a run that works)."""
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    processed = Path(
        os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    ).expanduser()
    short = name.split("/")[-1].lower()
    return (
        hub.is_dir()
        or Path(name).exists()  # load_dataset also reads a local folder of data files
        or (processed.is_dir() and any(short in e.name.lower() for e in processed.iterdir()))
    )


def resolve_path(path: str) -> Path:
    """``grimoire://REL`` -> the file inside the grimoire package; anything else as given.

    Relative paths stay relative, i.e. they resolve against the current working directory.
    """
    if path.startswith(PACKAGE_PREFIX):
        return PACKAGE_ROOT / path[len(PACKAGE_PREFIX) :]
    return Path(path).expanduser()


def source_problems(
    section: Any,
    where: str,
    extra_keys: Iterable[str] = (),
    check_files: bool = True,
    check_hub: bool = False,
) -> list[str]:
    """Every problem with a source section, as ``"<where>.<key>: ..."`` strings (no loading).

    ``extra_keys`` are keys the caller handles itself (the CLI's ``tokenize``); they are neither
    rejected nor checked here. With ``check_files`` local paths must exist; with ``check_hub``
    (config validation) a hub dataset must look cached when offline (:func:`load_source` itself
    just tries: the datasets library knows its cache better than this check).
    """
    if not isinstance(section, Mapping):
        return [f"{where}: expected a mapping (e.g. {{jsonl: data.jsonl}}), got {section!r}"]
    problems = _key_problems(section, where, set(extra_keys))
    kinds = [k for k in _KINDS if k in section]
    if len(kinds) != 1:
        got = f"got {kinds}" if kinds else "got none"
        problems.append(f"{where}: give exactly one of {list(_KINDS)}; {got}")
    if problems:
        return problems
    kind = kinds[0]
    if "subset" in section and "config" in section:
        problems.append(f"{where}: give subset or its alias config, not both")
    for key in ("subset", "config"):
        if key in section and kind != "name":
            problems.append(f"{where}.{key}: only applies to hub datasets (name:)")
    kind = _effective_kind(section, kind)
    if "split" in section and kind not in ("name", "load_from_disk"):
        problems.append(
            f"{where}.split: only applies to name:, load_from_disk: and folder path: sources"
        )
    if "seed" in section and not section.get("shuffle"):
        problems.append(f"{where}.seed: only used with shuffle: true")
    if section.get("max_samples") is not None and section["max_samples"] <= 0:
        problems.append(f"{where}.max_samples: must be > 0, got {section['max_samples']}")
    if check_hub and kind == "name" and hub_offline() and not hub_dataset_cached(section["name"]):
        problems.append(
            f"{where}.name: {section['name']!r} is not in the local Hugging Face cache and "
            "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE): load it once with network "
            "access, or save it with Dataset.save_to_disk and use load_from_disk:, or export it "
            "to jsonl:"
        )
    if check_files and kind != "name":
        key = next(k for k in _KINDS if k in section)
        path = resolve_path(section[key])
        if kind == "load_from_disk" and not path.is_dir():
            what = "a dataset folder (Dataset.save_to_disk) or a .jsonl/.json file"
            problems.append(
                f"{where}.{key}: folder not found: {path}{_relative_note(path)}"
                + (f" ({key}: takes {what})" if key == "path" else "")
            )
        elif kind != "load_from_disk" and not path.is_file():
            problems.append(f"{where}.{key}: file not found: {path}{_relative_note(path)}")
    return problems


def _key_problems(section: Mapping[str, Any], where: str, extra: set[str]) -> list[str]:
    """Unknown keys (with the nearest known one) and values of the wrong type."""
    known = [*SOURCE_KEYS, *extra]
    problems: list[str] = []
    for key, value in section.items():
        if key in extra:
            continue
        if key not in SOURCE_KEYS:
            problems.append(
                f"{where}.{key}: unknown key{did_you_mean(str(key), known)}; valid keys: "
                + ", ".join(known)
            )
            continue
        expected = SOURCE_KEYS[key]
        # bool is an int subclass; never accept True as a row count.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            problems.append(
                f"{where}.{key}: must be {expected.__name__}, got {type(value).__name__} {value!r}"
            )
    return problems


def _relative_note(path: Path) -> str:
    """Where a relative path was looked for (the current directory, not the YAML's folder)."""
    return "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"


def _effective_kind(section: Mapping[str, Any], kind: str) -> str:
    """``path`` is read as ``jsonl`` for a .jsonl/.json file, else as ``load_from_disk``."""
    if kind != "path":
        return kind
    return "jsonl" if str(section["path"]).endswith((".jsonl", ".json")) else "load_from_disk"


@dataclass
class LoadedSource:
    """A source read by :func:`read_source`: the readable rows, where each came from, and the
    lines that could not be read (reported together with the rows' own problems)."""

    dataset: Any  # datasets.Dataset of the readable rows
    locations: list[str] | None = None  # "file:line" of each row (JSONL sources)
    problems: list[str] = field(default_factory=list)  # unreadable lines, all of them


def read_source(section: Mapping[str, Any], where: str = "dataset") -> LoadedSource:
    """Like :func:`load_source`, but a JSONL file's unreadable lines are returned as
    ``problems`` beside the rows that could be read, each row with its ``file:line``.

    So the caller (``grimoire train``) reports a broken line and a row missing a field in one
    message instead of one after the other.
    """
    problems = source_problems(section, where)
    if problems:
        raise ConfigError(problems, title=f"invalid {where} section")
    kind = _effective_kind(section, next(k for k in _KINDS if k in section))
    lines: list[int] | None = None  # set, with path, for a JSONL file
    path: Path | None = None
    bad: list[str] = []
    if kind == "name":
        ds = _load_hub(section, where)
    elif kind == "load_from_disk":
        ds = _load_disk(section, where)
    else:
        path = resolve_path(section.get("jsonl") or section["path"])
        rows, lines, bad = _read_rows(path)
        if rows and lines is not None:  # carried through shuffle and max_samples, then removed
            rows = [{**row, _LINE_COLUMN: n} for row, n in zip(rows, lines)]
        ds = rows_to_dataset(rows, source=str(path))
    if len(ds) == 0:
        if bad:
            return LoadedSource(ds, [], bad)
        raise DataError([f"{where}: the source has no rows"])
    if section.get("shuffle"):
        ds = ds.shuffle(seed=section.get("seed", 42))
    if section.get("max_samples") is not None:
        ds = ds.select(range(min(section["max_samples"], len(ds))))
    locations = None
    if lines is not None:
        locations = [f"{path}:{n}" for n in ds[_LINE_COLUMN]]
        ds = ds.remove_columns(_LINE_COLUMN)
    return LoadedSource(ds, locations, bad)


def load_source(section: Mapping[str, Any], where: str = "dataset"):
    """Load a source section (see the module docstring) as a ``datasets.Dataset``.

    Raises :class:`ConfigError` for an invalid section or a missing file, and
    :class:`DataError` for unreadable contents (e.g. ``data.jsonl:7: invalid JSON ...``).
    """
    loaded = read_source(section, where)
    if loaded.problems:
        raise DataError(listed(loaded.problems), title=f"invalid JSONL file in {where}")
    return loaded.dataset


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[int] | None, list[str]]:
    """``(rows, line of each row, problems)``; lines are None for a ``.json`` array."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"file not found: {path}"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError([f"{path}: cannot read: {exc}"]) from exc
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return _json_array(text, path), None, []
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    problems: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(row, dict):
            problems.append(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            continue
        rows.append(row)
        lines.append(lineno)
    return rows, lines, problems


def rows_to_dataset(rows: Sequence[Mapping[str, Any]], source: str = "rows"):
    """A ``Dataset`` whose columns are the union of all rows' keys (absent values -> null).

    ``Dataset.from_list`` keeps only the first row's keys, which would silently drop a column
    that some later rows have; building columns explicitly keeps every field visible.
    """
    from datasets import Dataset

    columns: dict[str, list[Any]] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    table = {key: [row.get(key) for row in rows] for key in columns}
    try:
        return Dataset.from_dict(table)
    except Exception as exc:  # pyarrow raises several types for mixed column types
        raise DataError(
            [f"{source}: rows cannot form one table (a field has mixed types?): {exc}"]
        ) from exc


def tokenize_dataset(
    dataset: Any,
    fn: Callable[..., Mapping[str, Any]],
    *,
    source_name: str,
    locations: Sequence[str] | None = None,
    problems: Sequence[str] = (),
    **fn_kwargs: Any,
):
    """Apply a row-level tokenize function (e.g. ``tokenize_sft``) to every row of ``dataset``.

    ``fn(row, **fn_kwargs)`` must return a mapping of columns; the result holds only those
    columns (the originals are dropped). A ``DataError`` from any row is collected as
    ``"<source_name> row N: ..."`` (N is the 0-based index, i.e. ``dataset[N]``) and all of them
    are raised together as one ``DataError`` once every row has been tried. Null fields are
    passed to ``fn`` as absent, so a column missing from some JSONL rows reads as "missing".
    Other exceptions propagate with a note naming the row.

    ``locations`` (one ``file:line`` per row, from :func:`read_source`) lead each row's problem;
    ``problems`` found before (a JSONL file's unreadable lines) are reported in the same error.
    """
    found = list(problems)
    with counting_cuts() as cut:
        out = _tokenize_rows(dataset, fn, source_name, locations, found, fn_kwargs)
    if found:
        raise DataError(listed(found), title=f"invalid data in {source_name}")
    log_cuts(source_name, cut)
    if not out:
        raise DataError([f"{source_name}: no rows to tokenize"])
    return rows_to_dataset(out, source=source_name)


def _tokenize_rows(
    dataset: Any,
    fn: Callable[..., Mapping[str, Any] | None],
    source_name: str,
    locations: Sequence[str] | None,
    found: list[str],
    fn_kwargs: Mapping[str, Any],
) -> list[Mapping[str, Any]]:
    """``fn`` over every row; each row's ``DataError`` problems are appended to ``found``."""
    out: list[Mapping[str, Any]] = []
    for i, row in enumerate(dataset):
        example = {k: v for k, v in row.items() if v is not None}
        if i == 0:
            log_format(source_name, example)
        try:
            result = fn(example, **fn_kwargs)
            if result is not None:  # None: the tokenizer's truncation="drop" (counted)
                out.append(result)
        except DataError as exc:
            if locations is not None:
                found.extend(f"{locations[i]}: {p} ({source_name} row {i})" for p in exc.problems)
            else:
                found.extend(f"{source_name} row {i}: {p}" for p in exc.problems)
        except Exception as exc:
            if sys.version_info >= (3, 11):  # add_note is 3.11's
                where = f" ({locations[i]})" if locations is not None else ""
                exc.add_note(f"while tokenizing {source_name} row {i}{where}")
            raise
    return out


def _json_array(text: str, path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError([f"{path}:{exc.lineno}: invalid JSON: {exc.msg}"]) from exc
    bad = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    if bad:
        raise DataError([f"{path}: array items {bad[:10]} are not JSON objects"])
    return rows


def _load_hub(section: Mapping[str, Any], where: str):
    from datasets import load_dataset

    name, split = section["name"], section.get("split", "train")
    subset = section.get("subset", section.get("config"))
    try:
        return load_dataset(name, subset, split=split)
    except Exception as exc:
        hint = (
            "hub datasets need network access or a local copy; offline mode is on "
            "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE), so save the dataset once with "
            "Dataset.save_to_disk and use load_from_disk:, or export it to jsonl:"
            if hub_offline()
            else "check the name/subset/split; hub datasets need network access "
            "(or use load_from_disk:/jsonl: with a local copy)"
        )
        raise DataError(
            [
                f"{where}.name: cannot load {name!r} (split {split!r}): {type(exc).__name__}: {exc}"
                f" -- {hint}"
            ]
        ) from exc


def _load_disk(section: Mapping[str, Any], where: str):
    from datasets import DatasetDict, load_from_disk

    key = "load_from_disk" if "load_from_disk" in section else "path"
    path = resolve_path(section[key])
    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            [
                f"{where}.{key}: {path} is not a saved dataset "
                f"(written by save_to_disk): {type(exc).__name__}: {exc}"
            ]
        ) from exc
    if isinstance(ds, DatasetDict):
        split = section.get("split", "train")
        if split not in ds:
            raise DataError(
                [
                    f"{where}.split: {split!r} not in {path}; it has {sorted(ds)}"
                    f"{did_you_mean(split, [str(name) for name in ds])}"
                ]
            )
        ds = ds[split]
    return ds


__all__ = [
    "OFFLINE_VARS",
    "PACKAGE_PREFIX",
    "SOURCE_KEYS",
    "LoadedSource",
    "hub_dataset_cached",
    "hub_offline",
    "load_source",
    "read_source",
    "resolve_path",
    "rows_to_dataset",
    "source_problems",
    "tokenize_dataset",
]
