"""Pre-tokenized data (mini_trainer's JSONL format) and the ``pretrain`` block layout.

Row format: ``{"input_ids": [...], "labels": [...], "len": N}``; ``labels`` (``-100`` = not
trained) defaults to ``input_ids``; ``len`` is optional and, when given, must match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError


def tokenize_pretokenized(
    example: Mapping[str, Any], tokenizer: Any = None, max_length: int | None = None
) -> dict[str, list[int]]:
    """Check one pre-tokenized row and return ``input_ids`` / ``attention_mask`` / ``labels``.

    Rows longer than ``max_length`` are an error here, not silently cut: pre-tokenized data was
    prepared elsewhere, and truncating it would change what the author meant to train on.
    """
    del tokenizer  # already tokenized
    if "input_ids" not in example:
        raise DataError([f"pretokenized: missing field 'input_ids'; the row has {sorted(example)}"])
    ids = example["input_ids"]
    labels = example.get("labels")
    labels = list(ids) if labels is None else labels
    problems = []
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        problems.append("pretokenized: 'input_ids' must be a list of integers")
    elif not ids:
        problems.append("pretokenized: 'input_ids' is empty")
    if not isinstance(labels, list) or not all(isinstance(t, int) for t in labels):
        problems.append("pretokenized: 'labels' must be a list of integers (-100 = not trained)")
    elif isinstance(ids, list) and len(labels) != len(ids):
        problems.append(f"pretokenized: 'labels' has {len(labels)} entries, 'input_ids' {len(ids)}")
    if (
        "len" in example
        and example["len"] is not None
        and isinstance(ids, list)
        and example["len"] != len(ids)
    ):
        problems.append(f"pretokenized: 'len' is {example['len']} but 'input_ids' has {len(ids)}")
    if not problems and max_length is not None and len(ids) > max_length:
        problems.append(
            f"pretokenized: {len(ids)} tokens > max_length={max_length} (raise training.max_length)"
        )
    if not problems and all(t == IGNORE_INDEX for t in labels[1:]):
        problems.append("pretokenized: no trained label (all -100)")
    if problems:
        raise DataError(problems)
    return {"input_ids": list(ids), "attention_mask": [1] * len(ids), "labels": list(labels)}


def pretrain_blocks(
    rows: Iterable[Mapping[str, Any]], block_size: int, drop_last: bool = False
) -> list[dict[str, list[int]]]:
    """Concatenate documents' ``input_ids`` and cut the stream into ``block_size`` blocks.

    Each block carries ``position_ids`` that restart at 0 where a new document begins, so
    attention stays within documents and no token learns to predict across a boundary (the
    shared log-prob module drops targets at ``position_ids == 0``). Every token is trained
    (``labels = input_ids``). The last, shorter block is kept unless ``drop_last``.
    """
    if block_size < 2:
        raise DataError([f"pretrain: block_size must be >= 2, got {block_size}"])
    blocks: list[dict[str, list[int]]] = []
    ids: list[int] = []
    pos: list[int] = []
    for i, row in enumerate(rows):
        doc = row.get("input_ids") if isinstance(row, Mapping) else None
        if not doc:
            raise DataError([f"pretrain: row {i} has no 'input_ids'"])
        offset = 0
        while offset < len(doc):
            take = min(block_size - len(ids), len(doc) - offset)
            # Positions restart at every segment: a document cut across blocks starts afresh in
            # the next block (its earlier context is not in this row to attend to).
            ids.extend(doc[offset : offset + take])
            pos.extend(range(take))
            offset += take
            if len(ids) == block_size:
                blocks.append(_block(ids, pos))
                ids, pos = [], []
    if ids and not drop_last:
        blocks.append(_block(ids, pos))
    return blocks


pretrain_blocks.dataset_level = True  # type: ignore[attr-defined]  # CLI: whole-dataset transform


def _block(ids: list[int], pos: list[int]) -> dict[str, list[int]]:
    return {"input_ids": list(ids), "labels": list(ids), "position_ids": list(pos)}
