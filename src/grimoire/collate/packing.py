"""Collation stage of padding-free training: a planned micro-batch becomes one packed row.

:func:`pack_samples` turns the samples of one micro-batch into a single ``[1, L]`` row with
``position_ids`` restarting at 0 per sample (the padding-free layout varlen attention kernels
consume), and :func:`segment_sum` reduces per-position values of such a row back to per sample.
Which samples share a micro-batch is decided before, by :mod:`grimoire.batching.bin_packing`.

Nothing here touches a model or a process group; the trainer wires these together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Packed, shifted_targets
from grimoire.errors import DataError


def pack_samples(
    samples: list[dict[str, Any]],
    pad_token_id: int,
    columns: Sequence[str] = ("input_ids", "labels"),
    prefix: str = "",
    pad_to_multiple_of: int | None = None,
) -> dict[str, Any]:
    """Collate one micro-batch padding-free: all samples concatenated into a single row.

    Reads ``f"{prefix}{col}"`` from each sample for every ``col`` in ``columns`` (e.g.
    ``prefix="chosen_"`` for preference data) and writes un-prefixed keys:

    - each column: ``[1, L]``, the samples concatenated in the given order (``labels`` as-is,
      ``-100`` = not trained; integer columns come out as ``long``);
    - ``position_ids``: ``[1, L]`` long, restarting at 0 at every sample. This is what marks the
      sample boundaries: varlen attention derives the per-sample causal blocks from it, and
      :func:`grimoire.forward.logprobs.shift_labels` drops every target at a ``position_ids == 0``
      position, so a sample's last token never learns to predict the next sample's first token;
    - ``layout`` (:data:`~grimoire.contract.layout.LAYOUT_KEY`): a
      :class:`~grimoire.contract.layout.Packed` with the samples' host-side lengths (and so
      ``cu_seqlens``); the losses cut the row back into samples with it;
    - ``sample_index``: ``[1, L]`` long, which sample each position belongs to (for
      :func:`segment_sum`).

    There is no ``attention_mask``: a 2-D mask cannot express the block-diagonal structure, and
    passing one would make attention implementations fall back to padded semantics.

    ``pad_to_multiple_of`` pads the row at the end (e.g. for kernels that want aligned lengths)
    with ``pad_token_id`` / label ``-100`` / 0 for other columns, as its own segment
    (``position_ids`` restarting at 0, so no real token attends to it) with ``sample_index = -1``,
    which :func:`segment_sum` ignores. The layout's ``seq_lens`` exclude the padding.

    Raises:
        ValueError: for an empty ``samples`` list (dummy micro-batches reuse a real sample with
            loss weight 0 instead), and :class:`DataError` for missing columns, empty samples or
            columns of different lengths within a sample.
    """
    if not samples:
        raise ValueError(
            "pack_samples got an empty micro-batch; dummy micro-batches should reuse a real "
            "sample with loss weight 0"
        )
    if not columns:
        raise ValueError("pack_samples needs at least one column")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    per_col, seq_lens = _sample_columns(samples, [f"{prefix}{col}" for col in columns])
    total = sum(seq_lens)
    pad = -total % pad_to_multiple_of if pad_to_multiple_of else 0
    out: dict[str, Any] = {
        col: _joined(parts, col, pad, pad_token_id) for col, parts in zip(columns, per_col)
    }
    device = out[columns[0]].device
    sample_index, position_ids = _sample_positions(seq_lens, device)
    own = f"{prefix}position_ids"
    segments = None
    if all(own in s for s in samples):
        # Samples that already mark internal document boundaries (pretrain blocks) keep them.
        position_ids = torch.cat(
            [torch.as_tensor(s[own], dtype=torch.long).reshape(-1) for s in samples]
        ).to(device)
        segments = _segments(position_ids)
    targets = None
    if "labels" in out and device.type == "cpu":
        # Each sample's trained targets (the LM head's rows), counted while on the host (a row
        # packed on a device is not read back for them: the forward counts there).
        keep = shifted_targets(out["labels"][:, :total], position_ids.unsqueeze(0))[0]
        counts = torch.zeros(len(seq_lens), dtype=torch.long).index_add_(
            0, sample_index, keep.long()
        )
        targets = tuple(counts.tolist())
    if pad:
        sample_index = torch.cat([sample_index, sample_index.new_full((pad,), -1)])
        position_ids = torch.cat([position_ids, torch.arange(pad, device=device)])
    out["position_ids"] = position_ids.unsqueeze(0)
    out["sample_index"] = sample_index.unsqueeze(0)
    out[LAYOUT_KEY] = Packed(tuple(seq_lens), targets, segments)
    return out


def _sample_columns(
    samples: Sequence[Mapping[str, Any]], keys: Sequence[str]
) -> tuple[list[list[Tensor]], list[int]]:
    """Each key's per-sample 1-D tensors and each sample's length; every problem (a missing
    column, an empty sample, columns of different lengths) in one :class:`DataError`."""
    problems: list[str] = []
    per_col: list[list[Tensor]] = [[] for _ in keys]
    seq_lens: list[int] = []
    for si, sample in enumerate(samples):
        n = None
        for ci, key in enumerate(keys):
            if key not in sample:
                problems.append(f"sample {si}: missing column {key!r}")
                continue
            t = torch.as_tensor(sample[key]).reshape(-1)
            per_col[ci].append(t)
            if n is None:
                n = t.numel()
            elif t.numel() != n:
                problems.append(f"sample {si}: {key!r} has {t.numel()} values, expected {n}")
        if n == 0:
            problems.append(f"sample {si}: no tokens")
        seq_lens.append(n or 0)
    if problems:
        raise DataError(problems, title="cannot pack micro-batch")
    return per_col, seq_lens


def _joined(parts: list[Tensor], col: str, pad: int, pad_token_id: int) -> Tensor:
    """One column's ``[1, L]`` row: the samples back to back (integers as ``long``), then
    ``pad`` end positions of ``pad_token_id`` / ``-100`` (labels) / 0."""
    row = torch.cat(parts)
    if not row.is_floating_point() and row.dtype != torch.bool:
        row = row.long()
    if pad:
        fill = pad_token_id if col == "input_ids" else IGNORE_INDEX if col == "labels" else 0
        row = torch.cat([row, row.new_full((pad,), fill)])
    return row.unsqueeze(0)


def _sample_positions(seq_lens: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """``(sample_index, position_ids)`` of samples of ``seq_lens`` back to back, ``[sum]``
    long on ``device``: which sample each position is in, and its position there (from 0)."""
    total = sum(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    # output_size: the result's length is known on the host, so a device never syncs for it.
    sample_index = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), lens, output_size=total
    )
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.repeat_interleave(starts, lens, output_size=total)
    return sample_index, torch.arange(total, device=device) - offsets


def _segments(position_ids: Tensor) -> tuple[int, ...]:
    """Attention segments where ``position_ids`` restart (transformers' rule: a position that
    is not the previous + 1), counted on the host so no forward reads them back."""
    total = position_ids.numel()
    starts = torch.ones(total, dtype=torch.bool)
    starts[1:] = position_ids[1:].cpu() != position_ids[:-1].cpu() + 1
    bounds = [*starts.nonzero().flatten().tolist(), total]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def pack_row_sides(
    rows: Sequence[Mapping[str, Any]],
    sides: Sequence[str],
    pad_token_id: int,
    is_token_column: Callable[[str], bool],
) -> dict[str, Any]:
    """Pack several sequences per row (a preference pair's chosen/rejected, a KTO row and its KL
    pair) into one row: every row's first side, then every row's second side, and so on.

    ``f"{side}input_ids"`` / ``f"{side}labels"`` go through :func:`pack_samples`, so sample
    ``j * len(rows) + i`` is row ``i``'s side ``j`` (the batch's
    :class:`~grimoire.contract.layout.Packed` layout lists them in that order). Every other
    column (those ``is_token_column`` rejects) rides along per row: numeric values as a
    ``[len(rows)]`` tensor, anything else as a list.
    """
    samples = [
        {"input_ids": r[f"{side}input_ids"], "labels": r[f"{side}labels"]}
        for side in sides
        for r in rows
    ]
    batch: dict[str, Any] = pack_samples(samples, pad_token_id)
    for key in rows[0]:
        if is_token_column(key):
            continue
        values = [r[key] for r in rows]
        numeric = all(isinstance(v, bool | int | float) for v in values)
        batch[key] = torch.tensor(values) if numeric else values
    return batch


def segment_sum(values: Tensor, sample_index: Tensor, num_samples: int) -> Tensor:
    """Per-sample sums of a packed row: ``out[k] = sum(values[sample_index == k])``.

    ``values`` and ``sample_index`` have the same shape (``[1, L]`` or ``[L]``); positions with a
    negative ``sample_index`` (padding) are ignored. Differentiable in ``values``. Indices must be
    ``< num_samples`` (not checked: that would force a device sync). Returns ``[num_samples]`` in
    ``values``' dtype, e.g. per-sequence log-probs from per-token ones.
    """
    if values.shape != sample_index.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and sample_index {tuple(sample_index.shape)} must "
            "have the same shape"
        )
    vals = values.reshape(-1)
    idx = sample_index.reshape(-1).long()
    valid = idx >= 0
    vals = torch.where(valid, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
    out = torch.zeros(num_samples, dtype=vals.dtype, device=vals.device)
    return out.index_add(0, idx.clamp(min=0), vals)


def padding_fraction(
    lengths_per_micro: list[list[int]], padded: bool, pad_to_multiple_of: int = 1
) -> float:
    """Fraction of computed positions that are padding, over all micro-batches.

    ``lengths_per_micro[m]`` lists the sample lengths of micro-batch ``m``.

    - ``padded=True``: classic batching; micro-batch ``m`` is a ``[len(m), max(m)]`` rectangle.
    - ``padded=False``: padding-free packing; micro-batch ``m`` is one row of ``sum(m)`` tokens,
      rounded up to ``pad_to_multiple_of``.

    Empty micro-batches (the dummies of :func:`grimoire.batching.bin_packing.plan_global_batch`) compute
    nothing here; their cost is a separate question (the trainer runs a real sample for them).
    Returns 0.0 when no position is computed.
    """
    used = 0
    computed = 0
    for mb in lengths_per_micro:
        if not mb:
            continue
        tokens = sum(mb)
        used += tokens
        if padded:
            computed += len(mb) * max(mb)
        else:
            computed += -(-tokens // pad_to_multiple_of) * pad_to_multiple_of
    return 0.0 if computed == 0 else (computed - used) / computed


class PackedCollator:
    """Padding-free collator: a micro-batch of samples becomes one ``[1, L]`` packed row."""

    #: Read by the trainer's packing decision: given as ``data_collator``, it makes the run
    #: packed (a user's collator counts as padded without it).
    packed = True

    def __init__(self, pad_token_id: int, columns: Sequence[str] = ("input_ids", "labels")):
        self.pad_token_id = pad_token_id
        self.columns = tuple(columns)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return pack_samples(list(features), self.pad_token_id, columns=self.columns)
