"""Checks shared by every flat section of the YAML schema: unknown keys and value types.

Below both :mod:`grimoire.cli.schema` (the whole config) and :mod:`grimoire.cli.model` (the
``model:`` / ``quantization:`` sections), which each check sections this way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grimoire.config.training import check_type
from grimoire.errors import did_you_mean


def unknown_keys(
    section: Mapping[str, Any], known: Sequence[str], where: str, accepted: Iterable[str] = ()
) -> list[str]:
    """``where.key: unknown key (did you mean ...); valid keys: ...`` for each unknown key.

    ``accepted`` are spellings that are not listed as valid but may be what was meant (deprecated
    keys, which are moved before validation).
    """
    prefix = f"{where}." if where else ""
    valid = ", ".join(str(k) for k in known)
    return [
        f"{prefix}{k}: unknown key{did_you_mean(str(k), [*known, *accepted])}; valid keys: {valid}"
        for k in section
        if k not in known
    ]


def section_problems(
    section: Any, where: str, keys: Mapping[str, Any], accepted: Iterable[str] = ()
) -> list[str]:
    """Unknown keys and type errors of a flat section (``None`` = absent)."""
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [f"{where}: expected a mapping, got {type(section).__name__} {section!r}"]
    p = unknown_keys(section, list(keys), where, accepted)
    for key, hint in keys.items():
        if key in section and (msg := check_type(f"{where}.{key}", section[key], hint)):
            p.append(msg)
    return p


__all__ = ["section_problems", "unknown_keys"]
