"""Shared constants and token-column helpers for every stage (a leaf: imports no grimoire module).

- :data:`IGNORE_INDEX`: the label of a position that is not trained.
- :func:`columns_of`, :func:`column_values`, :func:`sequence_prefixes`: read the columns of a
  ``datasets.Dataset`` or of a list of dict rows alike.
- :func:`listed`: the first :data:`MAX_LISTED` problems of an error, the rest counted.
- :func:`pad_token_id_of`: the one rule for the id that fills padding.

They live here, below every stage, so that tokenizing rows or planning batches never imports
the model-facing modules (the fused head) just for a constant.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Any

#: Label of a position that is not trained (PyTorch's ``cross_entropy`` default ``ignore_index``).
IGNORE_INDEX = -100

#: How many problems an error lists before counting the rest (see :func:`listed`).
MAX_LISTED = 20


def columns_of(dataset: Any) -> list[str]:
    """Column names of a ``datasets.Dataset`` or a list of dict rows."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0].keys()) if len(dataset) else []
    return list(names)


def column_values(dataset: Any, name: str) -> list:
    """One column as a list (a whole-column read for ``datasets``, a row scan for lists)."""
    if hasattr(dataset, "column_names"):
        return list(dataset[name])
    return [row[name] for row in dataset]


def sequence_prefixes(columns: Any) -> list[str]:
    """``""``, ``"chosen_"``, ``"kl_"``, ...: one per ``*input_ids`` column (one sequence each)."""
    return [c[: -len("input_ids")] for c in columns if c.endswith("input_ids")]


def listed(problems: Iterable[str], limit: int = MAX_LISTED, more: str = "more") -> list[str]:
    """The first ``limit`` of ``problems``, then ``"... and K {more}"`` when K were left off.

    A whole dataset of bad rows should give a readable error, not a million lines. ``problems``
    may be a generator: the rest is only counted, never kept. ``more`` names what was left off
    (e.g. ``"more train rows over the budget"``).
    """
    it = iter(problems)
    shown = list(islice(it, limit))
    rest = sum(1 for _ in it)
    if rest:
        shown.append(f"... and {rest} {more}")
    return shown


def pad_token_id_of(tokenizer: Any = None, model: Any = None) -> int:
    """The id that fills padding: the first integer among the tokenizer's ``pad_token_id``, its
    ``eos_token_id``, the model config's ``pad_token_id``, its ``eos_token_id``; else 0.

    Padded positions are masked (attention mask, ``IGNORE_INDEX`` labels, or a fresh packed
    segment), so any id inside the vocabulary works; EOS is the usual stand-in when a tokenizer
    has no pad token, and 0 the last resort. A list-valued ``eos_token_id`` (several stop ids)
    is skipped. ``tokenizer`` and ``model`` may each be None.
    """
    for source in (tokenizer, getattr(model, "config", None)):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, int):
                return value
    return 0


__all__ = [
    "IGNORE_INDEX",
    "MAX_LISTED",
    "column_values",
    "columns_of",
    "listed",
    "pad_token_id_of",
    "sequence_prefixes",
]
