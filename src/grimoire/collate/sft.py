"""SFT collation: rows of :func:`grimoire.rows.sft.tokenize_sft` become padded tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.collate.common import collate_prefixed
from grimoire.collate.packing import PackedCollator
from grimoire.columns import IGNORE_INDEX


@dataclass
class SFTCollator:
    """Right-pads ``input_ids``/``labels``/``attention_mask`` into ``[B, T]`` tensors (layout
    :class:`~grimoire.contract.layout.Padded`)."""

    pad_token_id: int

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_prefixed(features, self.pad_token_id)


class PackedSFTCollator(PackedCollator):
    """grimoire-rl's packed SFT collator, by its name and arguments: a micro-batch becomes ONE
    packed ``[1, L]`` row (position_ids restarting per sample, no attention mask; layout
    :class:`~grimoire.contract.layout.Packed`).

    ``GrimoireTrainer(..., data_collator=PackedSFTCollator(tok.pad_token_id))`` trains packed:
    the collator says so (``packed = True``, as every :class:`PackedCollator`), so the trainer
    switches the model's attention to per-sample (grimoire-rl's version kept an all-ones
    attention mask, and sdpa/eager attention then crossed sample boundaries). The same as
    ``TrainingConfig(padding_free=True)``.

    Args:
        pad_token_id: kept for the signature (a packed row has no padding).
        label_pad_token_id: must be -100, the value every ``tokenize_*`` writes.
        max_length: a sample longer than this is cut to its first ``max_length`` tokens, as
            grimoire-rl did. The row itself holds the whole micro-batch (grimoire-rl started a
            new row every ``max_length`` tokens); bound a micro-batch's tokens with
            ``TrainingConfig.max_tokens_per_device``.
    """

    def __init__(
        self, pad_token_id: int = 0, label_pad_token_id: int = IGNORE_INDEX, max_length: int = 2048
    ):
        if label_pad_token_id != IGNORE_INDEX:
            raise ValueError(
                f"PackedSFTCollator: label_pad_token_id must be {IGNORE_INDEX} (what every "
                f"tokenize_* writes), got {label_pad_token_id}"
            )
        if max_length < 1:
            raise ValueError(f"PackedSFTCollator: max_length must be >= 1, got {max_length}")
        super().__init__(pad_token_id)
        self.max_length = max_length

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        cut = [{c: list(f[c])[: self.max_length] for c in self.columns} for f in features]
        return super().__call__(cut)


__all__ = ["PackedSFTCollator", "SFTCollator"]
