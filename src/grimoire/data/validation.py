"""Checks on tokenized datasets that run before training, naming every offending row."""

from __future__ import annotations

from typing import Any

from ..logprobs import IGNORE_INDEX

MAX_LISTED = 20


def _columns(dataset: Any) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0].keys()) if len(dataset) else []
    return list(names)


def _column(dataset: Any, name: str) -> list:
    if hasattr(dataset, "column_names"):
        return list(dataset[name])
    return [row[name] for row in dataset]


def validate_token_columns(
    dataset: Any, split: str, max_length: int | None, vocab_size: int | None
) -> list[str]:
    """Problems with every ``*input_ids`` / ``*labels`` column pair of ``dataset``.

    Checks: rows longer than ``max_length``, token ids outside ``[0, vocab_size)``, labels whose
    length differs from their ``input_ids``, and rows with no trained label at all (an empty
    response, or a prompt that filled the context).
    """
    problems: list[str] = []
    columns = _columns(dataset)
    for ids_col in [c for c in columns if c.endswith("input_ids")]:
        prefix = ids_col[: -len("input_ids")]
        ids = _column(dataset, ids_col)
        labels = _column(dataset, f"{prefix}labels") if f"{prefix}labels" in columns else None
        for i, row in enumerate(ids):
            where = f"{split} row {i}: {ids_col}"
            if max_length is not None and len(row) > max_length:
                problems.append(
                    f"{where} has {len(row)} tokens > max_length={max_length} "
                    "(re-tokenize with max_length, or raise training.max_length)"
                )
            if vocab_size is not None and row:
                lo, hi = min(row), max(row)
                if lo < 0 or hi >= vocab_size:
                    bad = lo if lo < 0 else hi
                    problems.append(
                        f"{where} has token id {bad} outside the model's vocabulary "
                        f"[0, {vocab_size}) (tokenizer and model do not match?)"
                    )
            if labels is not None:
                lab = labels[i]
                if len(lab) != len(row):
                    problems.append(
                        f"{split} row {i}: {prefix}labels has {len(lab)} entries but {ids_col} "
                        f"has {len(row)}"
                    )
                elif all(x == IGNORE_INDEX for x in lab[1:]):
                    problems.append(
                        f"{split} row {i}: {prefix}labels has no trained token (empty response, "
                        "or the prompt filled max_length)"
                    )
            if len(problems) > MAX_LISTED:
                return [*problems[:MAX_LISTED], "... (more problems not listed)"]
    return problems


def sample_lengths(dataset: Any) -> list[int]:
    """Tokens per sample, over every ``*input_ids`` column (chosen + rejected for pairs)."""
    cols = [c for c in _columns(dataset) if c.endswith("input_ids")]
    if not cols:
        return [1] * len(dataset)
    per_col = [[len(r) for r in _column(dataset, c)] for c in cols]
    return [sum(parts) for parts in zip(*per_col)]
