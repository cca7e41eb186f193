"""Shared pieces of the collators: padding integer lists (the one padding helper, the rollout's
prompts and completions included) and right-padding prefixed columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Padded, shifted_targets


def pad_sequences(
    seqs: Sequence[Sequence[int]], value: int, left: bool = False, min_width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer lists padded with ``value`` to the longest (at least ``min_width``), at their end
    or (``left``, prompts that generation appends to) their start: ``(ids, mask)``, both
    ``[B, T]`` long, ``mask`` 1 on the lists' own values."""
    width = max(min_width, max((len(s) for s in seqs), default=0))
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not len(s):
            continue
        where = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, where] = torch.as_tensor(s, dtype=torch.long)
        mask[i, where] = 1
    return ids, mask


def collate_prefixed(
    features: Sequence[Mapping[str, Any]], pad_token_id: int, prefixes: Sequence[str] = ("",)
) -> dict[str, Any]:
    """Right-pad ``{prefix}input_ids`` / ``labels`` / ``attention_mask`` for each prefix.

    Other numeric columns (e.g. cached reference log-probs) are stacked as tensors; strings are
    passed through as lists. The batch states its layout: :class:`~grimoire.contract.layout.Padded`,
    right-padded, with each prefix's trained targets counted here on the host.
    """
    batch: dict[str, Any] = {}
    targets = []
    for p in prefixes:
        ids, mask = pad_sequences([f[f"{p}input_ids"] for f in features], pad_token_id)
        batch[f"{p}input_ids"] = ids
        batch[f"{p}labels"] = pad_sequences([f[f"{p}labels"] for f in features], IGNORE_INDEX)[0]
        if f"{p}position_ids" in features[0]:
            # Rows that carry their own document boundaries (pretrain blocks): no attention mask,
            # so attention follows position_ids; padding continues the last segment's positions
            # (causal attention keeps real tokens from seeing it, and its labels are -100).
            batch[f"{p}position_ids"] = torch.stack(
                [
                    _continue_positions(f[f"{p}position_ids"], batch[f"{p}input_ids"].shape[1])
                    for f in features
                ]
            )
        else:
            batch[f"{p}attention_mask"] = mask
        keep = shifted_targets(batch[f"{p}labels"], batch.get(f"{p}position_ids"))
        targets.append((p, int(keep.sum())))
    handled = {
        f"{p}{k}"
        for p in prefixes
        for k in ("input_ids", "labels", "attention_mask", "position_ids")
    }
    for key in features[0]:
        if key in handled:
            continue
        values = [f[key] for f in features]
        if all(isinstance(v, bool | int | float) for v in values):
            batch[key] = torch.tensor(values)
        else:
            batch[key] = values
    # Right-padded unless a prefix carries its own position_ids (pretrain blocks: attention then
    # follows their restarts, so a plain causal pass would not be exact).
    own_positions = any(f"{p}position_ids" in batch for p in prefixes)
    tokens = sum(len(f[f"{p}input_ids"]) for p in prefixes for f in features)
    batch[LAYOUT_KEY] = Padded(
        tuple(targets), right_padded=not own_positions, tokens=tokens, rows=len(features)
    )
    return batch


def _continue_positions(pos: Sequence[int], width: int) -> torch.Tensor:
    out = torch.as_tensor(list(pos), dtype=torch.long)
    if len(out) < width:
        last = int(out[-1]) if len(out) else -1
        out = torch.cat([out, torch.arange(last + 1, last + 1 + width - len(out))])
    return out
