"""TRL's dataset formats, told apart by column names (and strings vs message lists).

``detect_format`` names a row's format the way TRL's dataset-formats guide does;
``tokenize_dataset`` logs it once per dataset so a run's log says how its rows were read. The
tokenizers accept every one of them as it is (docs/data-formats.md has a tested example each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``(format name, required columns, grimoire tokenizer)`` in detection order: the first whose
#: columns are all present wins (so ``prompt``/``completion``/``label`` is unpaired preference,
#: not prompt-completion).
FORMATS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("unpaired preference", ("prompt", "completion", "label"), "tokenize_kto"),
    ("preference (explicit prompt)", ("prompt", "chosen", "rejected"), "tokenize_preference"),
    ("preference (implicit prompt)", ("chosen", "rejected"), "tokenize_preference"),
    ("prompt-completion", ("prompt", "completion"), "tokenize_sft"),
    ("prompt-response (grimoire-rl)", ("prompt", "response"), "tokenize_sft"),
    ("language modelling", ("messages",), "tokenize_sft"),
    ("language modelling", ("text",), "tokenize_sft"),
    ("prompt-only", ("prompt",), "tokenize_grpo"),
)


def detect_format(row: Mapping[str, Any]) -> str | None:
    """The TRL format of ``row`` by its columns, ``"... , conversational"`` when its text
    columns hold message lists (``None`` for an unknown layout)."""
    for name, columns, _ in FORMATS:
        if all(c in row and row[c] is not None for c in columns):
            text = [row[c] for c in columns if c != "label"]
            kind = "conversational" if any(isinstance(v, list) for v in text) else "standard"
            return f"{name}, {kind}"
    return None


__all__ = ["FORMATS", "detect_format"]
