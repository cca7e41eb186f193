"""Prompt collation for online methods: ``GRPOCollator`` left-pads the prompts of
:func:`grimoire.rows.prompts.tokenize_grpo` (generation appends to the right) and passes the
other columns through as Python lists; :func:`prompt_token_lists` undoes the padding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grimoire.collate.common import pad_sequences
from grimoire.contract.layout import LAYOUT_KEY, Padded


@dataclass
class GRPOCollator:
    """Left-pads ``prompt_input_ids`` / ``prompt_attention_mask`` to ``[B, P]``; every other
    column is passed through as a list (reward functions get plain Python values). Layout:
    :class:`~grimoire.contract.layout.Padded` with ``prompts=True`` (generation takes padded
    prompts; a method meets such a batch only to evaluate it)."""

    pad_token_id: int

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ids, mask = pad_sequences(
            [list(f["prompt_input_ids"]) for f in features], self.pad_token_id, left=True
        )
        batch: dict[str, Any] = {"prompt_input_ids": ids, "prompt_attention_mask": mask}
        for key in features[0]:
            if key not in batch:
                batch[key] = [f.get(key) for f in features]
        batch[LAYOUT_KEY] = Padded(rows=len(features), prompts=True)
        return batch


def prompt_token_lists(batch: Mapping[str, Any]) -> list[list[int]]:
    """Unpadded prompt ids of a collated batch (drops the left padding)."""
    ids: torch.Tensor = batch["prompt_input_ids"]
    mask: torch.Tensor = batch["prompt_attention_mask"]
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


__all__ = ["GRPOCollator", "prompt_token_lists"]
