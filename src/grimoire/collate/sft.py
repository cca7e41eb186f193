"""SFT collation: rows of :func:`grimoire.rows.sft.tokenize_sft` become padded tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.collate.common import collate_prefixed


@dataclass
class SFTCollator:
    """Right-pads ``input_ids``/``labels``/``attention_mask`` into ``[B, T]`` tensors (layout
    :class:`~grimoire.collate.layout.Padded`)."""

    pad_token_id: int

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_prefixed(features, self.pad_token_id)


__all__ = ["SFTCollator"]
