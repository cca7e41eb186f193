"""Checks on tokenized datasets that run before training, naming every offending row."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grimoire.batching.budget import TokenBudget
from grimoire.columns import IGNORE_INDEX, column_values, columns_of, listed
from grimoire.contract.method import Method
from grimoire.errors import DataError


def validate_token_columns(
    dataset: Any, split: str, max_length: int | None, vocab_size: int | None
) -> list[str]:
    """Problems with every ``*input_ids`` / ``*labels`` column pair of ``dataset``.

    Checks: rows longer than ``max_length``, token ids outside ``[0, vocab_size)``, labels whose
    length differs from their ``input_ids``, and rows with no trained label at all (an empty
    response, or a prompt that filled the context).
    """
    return listed(_token_column_problems(dataset, split, max_length, vocab_size))


def _token_column_problems(
    dataset: Any, split: str, max_length: int | None, vocab_size: int | None
) -> Iterator[str]:
    # A generator: listed() keeps the first few problems and only counts the rest.
    columns = columns_of(dataset)
    for ids_col in [c for c in columns if c.endswith("input_ids")]:
        prefix = ids_col[: -len("input_ids")]
        ids = column_values(dataset, ids_col)
        labels = column_values(dataset, f"{prefix}labels") if f"{prefix}labels" in columns else None
        for i, row in enumerate(ids):
            where = f"{split} row {i}: {ids_col}"
            if max_length is not None and len(row) > max_length:
                yield (
                    f"{where} has {len(row)} tokens > max_length={max_length} "
                    "(re-tokenize with max_length, or raise training.max_length)"
                )
            if vocab_size is not None and row:
                lo, hi = min(row), max(row)
                if lo < 0 or hi >= vocab_size:
                    bad = lo if lo < 0 else hi
                    yield (
                        f"{where} has token id {bad} outside the model's vocabulary "
                        f"[0, {vocab_size}) (tokenizer and model do not match?)"
                    )
            if labels is not None:
                lab = labels[i]
                if len(lab) != len(row):
                    yield (
                        f"{split} row {i}: {prefix}labels has {len(lab)} entries but {ids_col} "
                        f"has {len(row)}"
                    )
                elif all(x == IGNORE_INDEX for x in lab[1:]):
                    yield (
                        f"{split} row {i}: {prefix}labels has no trained token (empty response, "
                        "or the prompt filled max_length)"
                    )


def validate_training_data(
    method: Method,
    datasets: dict[str, Any],
    max_length: int | None,
    vocab_size: int | None,
    budget: TokenBudget | None,
) -> None:
    """Every problem with the train / eval datasets, raised together before training: empty
    splits, the method's own checks (columns, classes), token columns, then rows that cannot fit
    the token budget."""
    problems: list[str] = []
    for split, ds in datasets.items():
        if ds is None:
            continue
        if len(ds) == 0:
            problems.append(f"{split} dataset is empty")
            continue
        problems += method.validate_dataset(ds, split)
        problems += validate_token_columns(ds, split, max_length=max_length, vocab_size=vocab_size)
    if budget is not None and not problems:
        for split, ds in datasets.items():
            if ds is not None:
                problems += budget.problems(ds, split)
    if problems:
        raise DataError(problems, title="invalid training data (nothing was trained)")
