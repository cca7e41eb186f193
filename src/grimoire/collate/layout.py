"""A collated batch's layout as a type: :class:`Padded` rows or one :class:`Packed` row.

Which forward a batch needs (a ``[B, T]`` call with an attention mask, or one ``[1, L]`` call with
``position_ids`` and no mask whose result is cut back into samples) used to be guessed from its
keys (``"seq_lens" in batch``) in every loss that cared. A key can be dropped, renamed or added by
a user collator without anyone noticing, and each guess had to be kept in step with the others.
Now whoever builds the batch (a collator, the rollout) says what it built, under
:data:`LAYOUT_KEY`, and :func:`grimoire.forward.batch.sample_token_logps` is the one place that
dispatches on it.

A batch without the key is :class:`Padded`: a user collator that returns a plain padded dict
keeps working unchanged.

Layouts are frozen, hashable and picklable (DataLoader workers collate in another process and
send the batch back), and hold only host-side Python values: reading them never waits for a
device. The trainer moves a batch's tensors to the device and passes every other value, the
layout included, through as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

#: The batch key under which a collator (or the rollout) states its batch's layout.
LAYOUT_KEY = "layout"


@dataclass(frozen=True)
class Padded:
    """``[B, T]`` rows, one sample per row, right-padded (left-padded prompts for generation),
    with an ``attention_mask`` (or, for pretrain blocks, ``position_ids`` marking document
    boundaries inside each row). A forward's result is already one row per sample."""


@dataclass(frozen=True)
class Packed:
    """One ``[1, L]`` row: the samples back to back, ``position_ids`` restarting at 0 at each,
    no attention mask (padding-free). A forward's result is cut back into per-sample rows.

    Attributes:
        seq_lens: each sample's token count, in row order, as HOST integers: the loss code can
            size and cut the row, and varlen attention kernels can be given ``cu_seqlens`` /
            ``max_seqlen``, without a device-to-host copy (which would stall the stream). Padding
            appended by ``pad_to_multiple_of`` is not a sample and is not counted: the row may be
            longer than ``sum(seq_lens)``.
    """

    seq_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        lens = tuple(int(n) for n in self.seq_lens)  # also accepts a list or numpy ints
        if not lens or min(lens) < 1:
            raise ValueError(f"Packed needs at least one sample, each of >= 1 token: {lens}")
        object.__setattr__(self, "seq_lens", lens)

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Sample offsets in the row, ``(0, l0, l0 + l1, ..., sum)`` (``num_samples + 1``
        values): flash-attention's varlen ``cu_seqlens``, and where to cut the row."""
        return (0, *accumulate(self.seq_lens))

    @property
    def max_seqlen(self) -> int:
        """The longest sample (varlen kernels' ``max_seqlen``; the width of unpacked rows)."""
        return max(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """The samples' tokens, without any end padding."""
        return sum(self.seq_lens)

    def split(self, n: int) -> tuple[Packed, Packed]:
        """The first ``n`` samples and the rest, as two packed rows (the row cut at
        ``cu_seqlens[n]``: positions restart at every sample, so each part is a valid row)."""
        if not 0 < n < self.num_samples:
            raise ValueError(f"cannot split {self.num_samples} packed samples after {n}")
        return Packed(self.seq_lens[:n]), Packed(self.seq_lens[n:])


#: What a batch's :data:`LAYOUT_KEY` holds.
BatchLayout = Padded | Packed


def layout_of(batch: Mapping[str, Any]) -> BatchLayout:
    """The batch's layout; :class:`Padded` when it states none (a user collator's plain dict).

    Raises:
        TypeError: when :data:`LAYOUT_KEY` holds something other than a layout (a user column
            that happens to be called ``layout`` would otherwise be misread silently).
    """
    layout = batch.get(LAYOUT_KEY)
    if layout is None:
        return Padded()
    if not isinstance(layout, Padded | Packed):
        raise TypeError(
            f"batch[{LAYOUT_KEY!r}] must be a Padded or Packed layout, got "
            f"{type(layout).__name__}; rename that column"
        )
    return layout


__all__ = ["LAYOUT_KEY", "BatchLayout", "Packed", "Padded", "layout_of"]
