"""Reading a run config: the YAML loader and ``--set`` overrides.

Shared by ``grimoire train`` / ``validate`` (:mod:`grimoire.cli.schema` re-exports these names)
and the tools that read the same config without running it (``grimoire estimate-memory``), so a
config means the same thing to each of them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from grimoire.errors import ConfigError

# --------------------------------------------------------------------------- YAML


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``2e-5`` as a float and rejects duplicate keys.

    PyYAML implements YAML 1.1, whose float pattern requires a dot (``2.0e-5``), so ``2e-5``
    would silently become the string ``"2e-5"``; learning rates are written that way all the time.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # A repeated key silently keeps the last value in plain PyYAML, hiding typos in
        # long configs; flag it instead.
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: let the base class report it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    """Parse a config document with :class:`ConfigLoader`; the top level must be a mapping."""
    try:
        data = yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: invalid YAML: {exc}"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping, got {type(data).__name__}"])
    return data


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """The config document at ``path`` (:func:`parse_yaml`); a ConfigError if unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"cannot read config {path}: {exc}"]) from exc
    return parse_yaml(text, str(path))


# --------------------------------------------------------------------------- --set


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=VALUE"`` -> ``(["a", "b"], value)``; VALUE is JSON, else kept as the raw string."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError([f"--set {item!r}: expected dotted.key=VALUE (VALUE is JSON)"])
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.strip()[:1] in "[{":
            # Meant as a list/mapping (e.g. [q_proj,v_proj]); as a string it would fail much
            # later, deep inside the library that reads it.
            raise ConfigError(
                [
                    f"--set {item!r}: the value looks like a JSON list/mapping but is not valid "
                    f"JSON ({exc.msg}); quote the strings, e.g. "
                    f'--set \'{key.strip()}=["q_proj","v_proj"]\''
                ]
            ) from exc
        value = text  # not JSON: a bare string such as --set training.run_name=my-run
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``--set`` applied in order (creating nested mappings)."""
    raw = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ConfigError as exc:
            problems += exc.problems
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                dotted = ".".join(parts[: depth + 1])
                problems.append(
                    f"--set {item!r}: {dotted} is a {type(child).__name__}, not a mapping"
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, title="invalid --set")
    return raw


__all__ = [
    "ConfigLoader",
    "apply_overrides",
    "parse_override",
    "parse_yaml",
    "read_yaml_file",
]
