"""Width buckets for padded micro-batches: every micro-batch's width rounded up to a multiple.

A padded micro-batch is as wide as its longest row, so on long-tailed data nearly every
micro-batch has a width never seen before. On a GPU each new shape can cost more than the step
itself: attention backends that build an execution plan per shape (cuDNN) build one, and
allocator blocks are cut anew. Rounding the width up to a multiple (``pad_to_multiple_of``,
64 by default on CUDA) bounds the shapes a run meets to ``max_length / multiple``.

The padding is exact: the extra positions are padding like any other (pad token, label -100,
attention mask 0) at the END of every row, so a real token never attends to them (causal) and
they are never a target; the loss, its units and the token count are unchanged
(``tests/test_gpu_step.py`` checks losses and gradients against unbucketed batches).

Only batches whose layout says they are right-padded (grimoire's own collators) are bucketed;
left-padded prompts (generation) and user collators are passed through as they are. Under a
token budget (``max_tokens_per_device``) a micro-batch is bucketed only when the rounded batch
still fits the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Padded
from grimoire.contract.method import Collator

#: How each token column of a right-padded group is extended, by its un-prefixed name.
_FILLS = {"labels": IGNORE_INDEX, "attention_mask": 0}

#: ``pad_to_multiple_of`` unset: the multiple on a CUDA device (a width bucket per 64 positions:
#: 32 shapes up to 2048, at most 63 extra positions per row). Elsewhere none: on a CPU a shape
#: costs nothing to meet, and the extra positions would be compute for nothing.
CUDA_MULTIPLE = 64


def bucket_multiple(setting: int | None, device_type: str) -> int:
    """The width multiple a run uses: ``setting`` (``pad_to_multiple_of``), else
    :data:`CUDA_MULTIPLE` on CUDA and 1 (no buckets) elsewhere."""
    if setting is not None:
        return setting
    return CUDA_MULTIPLE if device_type == "cuda" else 1


def round_up(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple`` (``multiple <= 1``: unchanged)."""
    return width if multiple <= 1 else -(-width // multiple) * multiple


def bucket_widths(
    batch: Mapping[str, Any], multiple: int, pad_token_id: int, max_tokens: int | None = None
) -> dict[str, Any]:
    """``batch`` with every token group (``{prefix}input_ids`` / ``labels`` /
    ``attention_mask``, ``[B, T]``) right-padded to a multiple of ``multiple``.

    Returned unchanged when the batch is not right-padded (its layout says so), when a ``[B, T]``
    tensor it does not know how to extend has a group's width (a user column), or when the
    rounded batch would hold more than ``max_tokens`` positions.
    """
    out = dict(batch)
    layout = batch.get(LAYOUT_KEY)
    if multiple <= 1 or not isinstance(layout, Padded) or not layout.right_padded:
        return out
    groups = [k[: -len("input_ids")] for k, v in batch.items() if _is_group(k, v)]
    known = {f"{p}{c}" for p in groups for c in ("input_ids", *_FILLS)}
    widths = {batch[f"{p}input_ids"].shape[1] for p in groups}
    for key, value in batch.items():
        unknown = isinstance(value, Tensor) and value.dim() >= 2 and key not in known
        if unknown and value.shape[1] in widths:
            return out  # a per-token column we cannot extend: leave the batch as it is
    total = sum(
        batch[f"{p}input_ids"].shape[0] * round_up(batch[f"{p}input_ids"].shape[1], multiple)
        for p in groups
    )
    if max_tokens is not None and total > max_tokens:
        return out
    for p in groups:
        width = round_up(batch[f"{p}input_ids"].shape[1], multiple)
        out[f"{p}input_ids"] = _extend(batch[f"{p}input_ids"], width, pad_token_id)
        for column, fill in _FILLS.items():
            if isinstance(batch.get(f"{p}{column}"), Tensor):
                out[f"{p}{column}"] = _extend(batch[f"{p}{column}"], width, fill)
    return out


def _is_group(key: str, value: Any) -> bool:
    return key.endswith("input_ids") and isinstance(value, Tensor) and value.dim() == 2


def _extend(t: Tensor, width: int, fill: int) -> Tensor:
    """Right-pad a ``[B, T]`` tensor with ``fill`` to ``[B, width]``."""
    if t.shape[1] >= width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)


class WidthBuckets:
    """A collator whose right-padded batches come out ``multiple``-wide (:func:`bucket_widths`).

    Picklable (DataLoader workers), and transparent: attributes it does not have are the
    wrapped collator's (e.g. ``max_length``, which a method's ``setup`` may set).
    """

    def __init__(
        self,
        collator: Collator,
        multiple: int,
        pad_token_id: int,
        max_tokens: int | None = None,
    ):
        self.collator, self.multiple = collator, multiple
        self.pad_token_id, self.max_tokens = pad_token_id, max_tokens

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(features)
        return bucket_widths(batch, self.multiple, self.pad_token_id, self.max_tokens)

    def __getattr__(self, name: str) -> Any:
        if name == "collator":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)


__all__ = ["CUDA_MULTIPLE", "WidthBuckets", "bucket_multiple", "bucket_widths", "round_up"]
