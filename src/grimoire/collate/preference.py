"""Preference collation: pairs of :func:`grimoire.rows.preference.tokenize_preference` become
one padded ``[B, T]`` per side (:class:`PreferenceCollator`) or one packed row
(:class:`PackedPairCollator`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grimoire.collate.common import collate_prefixed
from grimoire.collate.packing import pack_row_sides
from grimoire.columns import IGNORE_INDEX

#: A preference row's two sequences, by column prefix, in the order they are stacked or packed.
PAIR_SIDES: tuple[str, str] = ("chosen_", "rejected_")


def pad_right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Right-pad a ``[B, T]`` tensor with ``value`` to ``[B, width]`` (no-op when wide enough)."""
    if t.shape[1] >= width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]), value)
    return torch.cat([t, pad], dim=1)


@dataclass
class PreferenceCollator:
    """Pads ``chosen_*`` and ``rejected_*`` to ONE common width, ready to stack into ``[2B, T]``.

    A common width lets the loss run chosen and rejected through the model in a single forward
    without re-padding. Extra numeric columns (cached reference log-probs, margins) become
    tensors; strings pass through as lists. Layout: :class:`~grimoire.contract.layout.Padded`.
    """

    pad_token_id: int

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = collate_prefixed(features, self.pad_token_id, PAIR_SIDES)
        width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
        for side in PAIR_SIDES:
            batch[f"{side}input_ids"] = pad_right(
                batch[f"{side}input_ids"], width, self.pad_token_id
            )
            batch[f"{side}attention_mask"] = pad_right(batch[f"{side}attention_mask"], width, 0)
            batch[f"{side}labels"] = pad_right(batch[f"{side}labels"], width, IGNORE_INDEX)
        return batch


class PackedPairCollator:
    """Padding-free pairs: the micro-batch's chosen then rejected responses as one packed row.

    Other numeric columns (cached reference log-probs, margins) are stacked as tensors. Layout:
    :class:`~grimoire.contract.layout.Packed` of ``2B`` samples, the chosen ones first.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return pack_row_sides(
            features, PAIR_SIDES, self.pad_token_id, lambda key: key.startswith(PAIR_SIDES)
        )


__all__ = ["PAIR_SIDES", "PackedPairCollator", "PreferenceCollator", "pad_right"]
