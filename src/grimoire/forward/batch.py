"""One forward per batch layout: per-sample token log-probs from padded rows or a packed row.

A batch states its layout (:func:`grimoire.contract.layout.layout_of`); :func:`layout_token_logps`
is the one place that turns it into a forward (every loss's, the rollout's completion scoring
too), and :func:`sample_token_logps` its per-sample rows:

- :class:`~grimoire.contract.layout.Padded`: one call on the ``[B, T]`` rows with their
  ``attention_mask``; the result is already one row per sample;
- :class:`~grimoire.contract.layout.Packed`: one call on the ``[1, L]`` row with its
  ``position_ids`` and NO mask (a 2-D mask cannot express the per-sample causal blocks), then
  :func:`unpack_rows` lays the result out as ``[num_samples, max_len]`` rows, exactly what the
  same samples padded would give.

Either way the caller gets per-sample rows ``TokenLogps [N, T]``, so loss code downstream never
asks which layout it got. Batches whose rows hold several sequences (a preference pair's
``chosen_``/``rejected_``, a KTO row's own completion and its ``kl_`` pair: "sides") are served by
:func:`side_rows` (each side on its own, e.g. with and without gradient) and
:func:`sides_token_logps` (all sides in ONE forward, split per side).

``compute(input_ids, labels, attention_mask, position_ids, layout) -> TokenLogps`` is the model
call (:func:`grimoire.losses.preference.policy_compute`,
:meth:`grimoire.forward.reference.Reference.compute`); ``layout`` is the rows' own (a side's,
or all sides stacked), with the host-side counts that let the forward skip its device reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from grimoire.collate.preference import pad_right
from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import BatchLayout, Packed, Padded, attention_inputs, layout_of
from grimoire.forward.logprobs import TokenLogps

#: ``compute(input_ids, labels, attention_mask, position_ids, layout) -> TokenLogps``.
TokenLogpsFn = Callable[[Tensor, Tensor, "Tensor | None", "Tensor | None", BatchLayout], TokenLogps]
#: What a layout-dispatched model call returns: token log-probs, or a caller's own (e.g. logits).
R = TypeVar("R")


def unpack_rows(out: TokenLogps, layout: Packed) -> TokenLogps:
    """A packed ``[1, L]`` result laid out as ``[num_samples, max_len]`` rows (zeros past each
    sample's end), i.e. exactly what the same samples padded would give.

    The gather index is built on the host from the layout's host-side lengths and copied over
    without blocking: no device-to-host sync (a device tensor of lengths would need one for the
    width). End padding of the row (``pad_to_multiple_of``) belongs to no sample and is dropped.
    """
    row_len = out.logps.shape[1]
    lens = torch.tensor(layout.seq_lens)
    starts = torch.tensor(layout.cu_seqlens[:-1])
    offsets = torch.arange(layout.max_seqlen)
    valid = offsets[None, :] < lens[:, None]
    index = (starts[:, None] + offsets[None, :]).clamp(max=row_len - 1)
    device = out.logps.device
    index, valid = index.to(device, non_blocking=True), valid.to(device, non_blocking=True)

    def rows(t: Tensor) -> Tensor:
        return t[0][index].masked_fill(~valid, 0.0)

    entropy = None if out.entropy is None else rows(out.entropy)
    return TokenLogps(rows(out.logps), out.mask[0][index] & valid, entropy)


def layout_token_logps(
    compute: Callable[[Tensor, Tensor, Tensor | None, Tensor | None, BatchLayout], R],
    input_ids: Tensor,
    labels: Tensor,
    layout: BatchLayout,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> R:
    """THE dispatch on a batch's layout: ``compute`` called with the inputs the layout takes,
    and its result as it comes, ``[B, T]`` for padded rows, ``[1, L]`` for a packed row.

    Padded: ``compute`` on the ``[B, T]`` rows with ``attention_mask`` (and ``position_ids`` if
    given, e.g. pretrain blocks). Packed: ``compute`` on the ``[1, L]`` row with
    ``position_ids`` (required: they mark the samples' boundaries) and no mask.

    Raises:
        ValueError: for a packed row without ``position_ids`` or with an ``attention_mask``
            (with one, attention would fall back to padded semantics across samples).
    """
    if isinstance(layout, Packed):
        if position_ids is None or attention_mask is not None:
            raise ValueError(
                "a packed row is scored with its position_ids and without an attention_mask"
            )
        return compute(input_ids, labels, None, position_ids, layout)
    return compute(input_ids, labels, attention_mask, position_ids, layout)


def sample_token_logps(
    compute: TokenLogpsFn,
    input_ids: Tensor,
    labels: Tensor,
    layout: BatchLayout,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> TokenLogps:
    """Per-sample token log-probs ``[N, T]`` of one forward, whatever the layout:
    :func:`layout_token_logps`, a packed row's result cut back into samples
    (:func:`unpack_rows`)."""
    out = layout_token_logps(compute, input_ids, labels, layout, attention_mask, position_ids)
    return unpack_rows(out, layout) if isinstance(layout, Packed) else out


@dataclass(frozen=True)
class LayoutRows:
    """One forward's token tensors and their layout (padded ``[B, T]`` rows with a mask, or a
    packed ``[1, L]`` row with ``position_ids``)."""

    input_ids: Tensor
    labels: Tensor
    layout: BatchLayout
    attention_mask: Tensor | None = None
    position_ids: Tensor | None = None

    @classmethod
    def of(cls, batch: Mapping[str, Any]) -> LayoutRows:
        """A batch's own rows (``input_ids``, ``labels`` and what its layout takes)."""
        mask, position_ids = attention_inputs(batch)
        return cls(batch["input_ids"], batch["labels"], layout_of(batch), mask, position_ids)

    def token_logps(self, compute: TokenLogpsFn) -> TokenLogps:
        """``[rows, T]`` per-sample token log-probs (:func:`sample_token_logps`)."""
        return sample_token_logps(compute, *self._inputs())

    def forward(self, compute: TokenLogpsFn) -> TokenLogps:
        """The forward's own result, a packed row not cut (:func:`layout_token_logps`)."""
        return layout_token_logps(compute, *self._inputs())

    def _inputs(self) -> tuple[Tensor, Tensor, BatchLayout, Tensor | None, Tensor | None]:
        return self.input_ids, self.labels, self.layout, self.attention_mask, self.position_ids


def rows_per_side(batch: Mapping[str, Any], sides: Sequence[str]) -> int:
    """Rows of a batch whose rows hold ``len(sides)`` sequences each (pairs, KTO rows)."""
    layout = layout_of(batch)
    if isinstance(layout, Packed):
        return layout.num_samples // len(sides)
    return int(batch[f"{sides[0]}input_ids"].shape[0])


def side_rows(batch: Mapping[str, Any], sides: Sequence[str]) -> list[LayoutRows]:
    """Each side's rows on its own: padded, the side's prefixed columns (a missing mask is all
    ones, missing labels are the ids); packed, the row cut at the side boundaries, which are
    sample boundaries (positions restart at every sample, so each part is a valid packed row;
    the packed collators put every row's first side first, then every row's second, ...)."""
    layout = layout_of(batch)
    if isinstance(layout, Packed):
        n = rows_per_side(batch, sides)
        if n * len(sides) != layout.num_samples:
            raise ValueError(
                f"a packed batch of {layout.num_samples} samples cannot hold {len(sides)} sides"
            )
        cu = layout.cu_seqlens
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        parts = []
        for j in range(len(sides)):
            a, b = cu[j * n], cu[(j + 1) * n]
            t = layout.targets
            part = Packed(layout.seq_lens[j * n : (j + 1) * n], t and t[j * n : (j + 1) * n])
            parts.append(LayoutRows(ids[:, a:b], labels[:, a:b], part, None, pos[:, a:b]))
        return parts
    parts = []
    padded = layout if isinstance(layout, Padded) else Padded()
    for side in sides:
        ids = batch[f"{side}input_ids"]
        mask = attention_inputs(batch, side)[0]
        labels = batch.get(f"{side}labels")
        parts.append(
            LayoutRows(
                ids,
                labels if labels is not None else ids,
                padded.sides((side,)) if labels is not None else Padded(),
                mask if mask is not None else torch.ones_like(ids),
            )
        )
    return parts


def stack_rows(
    parts: list[tuple[Tensor, Tensor, Tensor]], pad_value: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Stack several ``(input_ids, attention_mask, labels)`` groups into one ``[sum B, T]``.

    Groups are right-padded to a common width first: the padded positions are masked and
    labelled -100, and with right padding a causal model's outputs at real positions are
    unaffected, so the result is exactly that of separate forwards.
    """
    width = max(ids.shape[1] for ids, _, _ in parts)
    ids = torch.cat([pad_right(i, width, pad_value) for i, _, _ in parts])
    mask = torch.cat([pad_right(m, width, 0) for _, m, _ in parts])
    labels = torch.cat([pad_right(lab, width, IGNORE_INDEX) for _, _, lab in parts])
    return ids, mask, labels


def stacked_sides(
    batch: Mapping[str, Any], sides: Sequence[str], pad_value: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """A padded batch's sides stacked along the batch dimension, first side first:
    ``[len(sides) * B, T]`` input_ids / attention_mask / labels."""
    if not isinstance(layout_of(batch), Padded):
        raise ValueError("stacked_sides takes a padded batch (a packed row is already stacked)")
    groups = [(p.input_ids, p.attention_mask, p.labels) for p in side_rows(batch, sides)]
    return stack_rows(groups, pad_value)  # type: ignore[arg-type]  # padded sides have masks


def joint_rows(batch: Mapping[str, Any], sides: Sequence[str]) -> LayoutRows:
    """Every side in ONE forward: a packed row as it is (its sides are already back to back),
    padded sides stacked along the batch dimension (:func:`stacked_sides`)."""
    layout = layout_of(batch)
    if isinstance(layout, Packed):
        return LayoutRows(batch["input_ids"], batch["labels"], layout, None, batch["position_ids"])
    ids, mask, labels = stacked_sides(batch, sides)
    return LayoutRows(ids, labels, layout.sides(tuple(sides)), mask)


def sides_token_logps(
    compute: TokenLogpsFn, batch: Mapping[str, Any], sides: Sequence[str]
) -> list[TokenLogps]:
    """Per-side ``[B, T]`` token log-probs from ONE forward over all sides (so a DDP/FSDP-wrapped
    model is called once and every side sees the same weights, dropout state and kernels)."""
    out = joint_rows(batch, sides).token_logps(compute)
    n = rows_per_side(batch, sides)

    def part(t: Tensor | None, j: int) -> Tensor | None:
        return None if t is None else t[j * n : (j + 1) * n]

    return [
        TokenLogps(
            out.logps[j * n : (j + 1) * n], out.mask[j * n : (j + 1) * n], part(out.entropy, j)
        )
        for j in range(len(sides))
    ]


__all__ = [
    "LayoutRows",
    "TokenLogpsFn",
    "joint_rows",
    "layout_token_logps",
    "rows_per_side",
    "sample_token_logps",
    "side_rows",
    "sides_token_logps",
    "stack_rows",
    "stacked_sides",
    "unpack_rows",
]
