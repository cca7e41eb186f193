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
    keys = [f"{prefix}{col}" for col in columns]
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

    total = sum(seq_lens)
    pad = 0
    if pad_to_multiple_of is not None and pad_to_multiple_of > 1:
        pad = -total % pad_to_multiple_of

    out: dict[str, Any] = {}
    for col, parts in zip(columns, per_col):
        row = torch.cat(parts)
        if not row.is_floating_point() and row.dtype != torch.bool:
            row = row.long()
        if pad:
            fill = pad_token_id if col == "input_ids" else IGNORE_INDEX if col == "labels" else 0
            row = torch.cat([row, row.new_full((pad,), fill)])
        out[col] = row.unsqueeze(0)

    lens = torch.tensor(seq_lens, dtype=torch.long)
    num = len(seq_lens)
    sample_index = torch.repeat_interleave(torch.arange(num), lens)
    starts = torch.cumsum(lens, 0) - lens
    position_ids = torch.arange(total) - torch.repeat_interleave(starts, lens)
    own = f"{prefix}position_ids"
    if all(own in s for s in samples):
        # Samples that already mark internal document boundaries (pretrain blocks) keep them.
        position_ids = torch.cat(
            [torch.as_tensor(s[own], dtype=torch.long).reshape(-1) for s in samples]
        )
    segments = None
    if all(own in s for s in samples):
        # Attention segments where position_ids restart (transformers' rule: a position that is
        # not the previous + 1), counted here on the host so no forward reads them back.
        starts = torch.ones(total, dtype=torch.bool)
        starts[1:] = position_ids[1:] != position_ids[:-1] + 1
        bounds = [*starts.nonzero().flatten().tolist(), total]
        segments = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    targets = None
    if "labels" in out:
        # Each sample's trained targets (the LM head's rows), counted while on the host.
        keep = shifted_targets(out["labels"][:, :total], position_ids.unsqueeze(0))[0]
        targets = torch.zeros(len(seq_lens), dtype=torch.long).index_add_(
            0, sample_index, keep.long()
        )
    if pad:
        sample_index = torch.cat([sample_index, sample_index.new_full((pad,), -1)])
        position_ids = torch.cat([position_ids, torch.arange(pad)])
    out["position_ids"] = position_ids.unsqueeze(0)
    out["sample_index"] = sample_index.unsqueeze(0)
    counts = None if targets is None else tuple(targets.tolist())
    out[LAYOUT_KEY] = Packed(tuple(seq_lens), counts, segments)
    return out


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

    def __init__(self, pad_token_id: int, columns: Sequence[str] = ("input_ids", "labels")):
        self.pad_token_id = pad_token_id
        self.columns = tuple(columns)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return pack_samples(list(features), self.pad_token_id, columns=self.columns)
