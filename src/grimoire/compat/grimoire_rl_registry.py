"""grimoire-rl's ``grimoire.registry``: short names -> losses and tokenize functions.

What ``grimoire.registry`` (a thin module at grimoire-rl's path) exports: a layer over
:mod:`grimoire.config.registry` (the registry the YAML uses), with grimoire-rl's names: ``LOSSES`` and ``TOKENIZERS`` (short name -> ``"package.module:Name"``),
``get_loss_class(name)`` and ``get_tokenize_fn(name)``. Both getters accept a short name or a
``package.module:Name`` spec (**importing a spec runs that module's code**). An unknown name
raises :class:`UnknownNameError`: a ``ConfigError`` (so a ``ValueError``) that is also a
``KeyError``, which is what grimoire-rl raised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from grimoire.config.registry import CALLBACKS, LOSSES, TOKENIZERS, is_spec, resolve
from grimoire.errors import ConfigError, did_you_mean


class UnknownNameError(ConfigError, KeyError):
    """A short name that no registry holds (a ``ConfigError`` and a ``KeyError``)."""

    # KeyError's own __str__ would print the message as a quoted repr.
    __str__ = Exception.__str__


def _get(name: str, registry: Mapping[str, str], kind: str, key: str) -> Any:
    if isinstance(name, str) and name and not is_spec(name) and name not in registry:
        known = ", ".join(sorted(registry))
        raise UnknownNameError(
            [
                f"unknown {kind} {name!r}{did_you_mean(name, registry)}; known: {known} "
                f"(or pass a full 'package.module:Name' spec)"
            ]
        )
    return resolve(name, registry, key)


def get_loss_class(name: str) -> type:
    """The loss / method class for a short name (``"dpo"``) or ``"package.module:Class"``."""
    return _get(name, LOSSES, "loss", "loss.type")


def get_tokenize_fn(name: str) -> Callable[..., dict[str, Any]]:
    """The row tokenize function for a short name (``"sft"``, ``"prompt"``) or a spec."""
    return _get(name, TOKENIZERS, "tokenize", "dataset.tokenize.type")


__all__ = [
    "CALLBACKS",
    "LOSSES",
    "TOKENIZERS",
    "UnknownNameError",
    "get_loss_class",
    "get_tokenize_fn",
]
