"""What the host knows about a forward's rows, handed to grimoire's attention without a sync.

transformers builds a model's attention mask from the device tensors it is given, and reads them
back to do so: for a packed row it looks for ``position_ids`` restarts
(``find_packed_sequence_indices``: ``.all()`` on the device), for padded rows it checks whether
the mask could be skipped (``_ignore_causal_mask_sdpa``: two more). Each read is a host sync, one
or two per forward. The collator knew all of it on the host (the layout: sample lengths, right
padding), so for a model whose attention is grimoire's (:data:`PACKED_ATTENTION`,
:mod:`grimoire.model.packed_attention`) :func:`attention_hint` hands it over instead, as the
model's ``attention_mask``:

- a **4-D** tensor, which transformers' mask builder passes through untouched (an "already
  prepared" mask): nothing is read;
- with no elements (``[1, 1, 0, 0]``, bool): if it ever reached an attention function that does
  not know it, that function fails on the shape instead of silently attending everywhere;
- carrying a :class:`RowsHint` as an attribute: ``"packed"`` (causal within each segment of the
  one packed row; the host-side segment lengths, and ``cu_seqlens`` on the device for varlen
  kernels, built once per forward and shared by every layer and the checkpoint recompute) or
  ``"causal"`` (right-padded rows: plain causal attention is exact for every real token, as a
  real token never sees a later position, so no mask at all).

Any other batch (no layout, left padding, another attention implementation) keeps the model's
own mask building, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.contract.layout import BatchLayout, Packed, Padded

#: The attention implementation name :mod:`grimoire.model.packed_attention` registers under.
PACKED_ATTENTION = "grimoire_packed_sdpa"
#: The one :mod:`grimoire.model.ulysses_attention` registers under (sequence parallelism).
ULYSSES_ATTENTION = "grimoire_ulysses"

_ATTR = "_grimoire_rows"


class RowsHint:
    """The host-side facts behind a marker mask (see the module docstring).

    Attributes:
        kind: ``"packed"`` or ``"causal"``.
        segments: (packed) the causal segments' lengths, covering the whole row.
        max_seqlen: (packed) the longest segment.
    """

    __slots__ = ("_cu", "device", "kind", "max_seqlen", "segments")

    def __init__(self, kind: str, device: torch.device, segments: tuple[int, ...] = ()):
        self.kind, self.device, self.segments = kind, device, segments
        self.max_seqlen = max(segments, default=0)
        self._cu: Tensor | None = None

    @property
    def cu_seqlens(self) -> Tensor:
        """``[num_segments + 1]`` int32 offsets on the device, copied from the host once (without
        blocking: no host sync) and reused by every layer of the forward."""
        if self._cu is None:
            offsets, total = [0], 0
            for n in self.segments:
                total += n
                offsets.append(total)
            host = torch.tensor(offsets, dtype=torch.int32)
            self._cu = host.to(self.device, non_blocking=self.device.type != "cpu")
        return self._cu

    def __repr__(self) -> str:
        return f"RowsHint({self.kind!r}, segments={self.segments})"


def rows_hint(mask: Any) -> RowsHint | None:
    """The hint a marker mask carries (None for any other mask)."""
    return getattr(mask, _ATTR, None) if isinstance(mask, Tensor) else None


def marker(hint: RowsHint) -> Tensor:
    """An empty 4-D bool tensor carrying ``hint`` (the model's ``attention_mask``)."""
    mask = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=hint.device)
    setattr(mask, _ATTR, hint)
    return mask


def attention_impl(model: torch.nn.Module) -> str | None:
    """The attention implementation of ``model``'s config (through DDP / PEFT wrappers)."""
    for _ in range(8):
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation
        inner = getattr(model, "module", None) or getattr(model, "base_model", None)
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return None
        model = inner
    return None


def attention_hint(
    model: torch.nn.Module,
    layout: BatchLayout | None,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> Tensor | None:
    """The marker mask to pass instead of ``attention_mask`` (None: keep the model's own).

    Only for a model whose attention is :data:`PACKED_ATTENTION`: a packed ``[1, L]`` row given
    with its ``position_ids`` and no mask, or right-padded rows without ``position_ids``.
    """
    if layout is None or attention_impl(model) != PACKED_ATTENTION:
        return None
    device = input_ids.device
    if isinstance(layout, Packed):
        if attention_mask is not None or position_ids is None or input_ids.shape[0] != 1:
            return None
        return marker(RowsHint("packed", device, layout.attention_segments(input_ids.shape[1])))
    if isinstance(layout, Padded) and layout.right_padded and position_ids is None:
        return marker(RowsHint("causal", device))
    return None


__all__ = [
    "PACKED_ATTENTION",
    "ULYSSES_ATTENTION",
    "RowsHint",
    "attention_hint",
    "attention_impl",
    "marker",
    "rows_hint",
]
