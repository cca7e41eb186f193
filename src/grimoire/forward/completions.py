"""Completion log-probs: the online methods' forward, the one place its formula is written.

A batch of completions (the rollout's training batches, and the rows an engine scores) holds
``N`` rows of ``[left-padded prompt | right-padded completion]`` and ``[N, C]`` per-token
columns (``completion_mask``, ``old_logps``, ``sampler_logps``, ``ref_logps``):

- padded: ``input_ids / attention_mask [N, P + C]``;
- packed: the real tokens of the ``N`` rows as ONE ``[1, L]`` row (``input_ids``, ``labels``,
  ``position_ids`` and the :class:`~grimoire.contract.layout.Packed` layout), and
  ``completion_index [N, C]``: where each completion token sits in that row (``-1`` on padding).

:func:`batch_completion_logps` scores either with the logits divided by the sampling
temperature, so the log-probs are those of the distribution that was sampled (PPO's ratio must
compare like with like; TRL does the same)::

    logps[i, t] = log softmax(logits[i, P - 1 + t] / T)[completion[i, t]]

The engines' old log-probs (:meth:`grimoire.rollout.engines.base.RolloutEngine.score`, through
:func:`completion_logps`), the policy's and the reference's in the losses all come from it.
:func:`select_rows` takes some rows of a padded batch (a method's selection of a group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.packing import pack_samples
from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Packed, Padded, layout_of, shift_labels
from grimoire.forward.batch import LayoutRows, TokenLogpsFn
from grimoire.forward.logprobs import (
    TokenLogps,
    compute_token_logps,
    logps_from_logits,
    token_entropy,
)
from grimoire.forward.sequence_split import sequence_group

#: A padded completion batch's token columns, ``[N, P + C]``; its other tensors are ``[N, C]``.
TOKEN_COLUMNS = ("input_ids", "attention_mask")


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """``cumsum(mask) - 1`` clamped at 0: left-padded rows get the positions HF ``generate`` used.

    Without it a left-padded prompt would be scored at positions shifted by its padding, so the
    training log-probs would not be those of the sampled sequence.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_labels(input_ids: Tensor, attention_mask: Tensor, completion_width: int) -> Tensor:
    """The targets of ``[N, P + C]`` rows: their real completion tokens, -100 elsewhere."""
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :-completion_width] = IGNORE_INDEX
    return labels


def select_rows(batch: dict[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """The padded completion batch of ``rows`` of ``batch`` (a padded one), its completion
    width trimmed to their longest (every real token: an episode's tool results too).

    No rows (every group dropped, no pair formed) -> row 0 with an all-zero ``completion_mask``:
    loss 0 and 0 loss units, yet a forward/backward runs, as every rank must for DDP to stay in
    step.
    """
    keep = list(rows) or [0]
    mask = batch["completion_mask"]
    idx = torch.tensor(keep, device=mask.device)
    c = mask.shape[1]
    width = max(1, int(batch["attention_mask"][idx, -c:].sum(-1).max()))
    cut = batch["input_ids"].shape[1] - c + width
    out = {
        k: v[idx, :cut] if k in TOKEN_COLUMNS else v[idx, :width]
        for k, v in batch.items()
        if isinstance(v, Tensor)
    }
    if not rows:
        out["completion_mask"] = torch.zeros_like(out["completion_mask"])
    return {**out, LAYOUT_KEY: Padded(rows=len(keep))}


def packed_columns(
    input_ids: Tensor, attention_mask: Tensor, labels: Tensor, completion_width: int
) -> dict[str, Any]:
    """The real tokens of ``[N, P + C]`` rows packed into ONE row by
    :func:`~grimoire.collate.packing.pack_samples` (``input_ids``, ``labels``,
    ``position_ids``, ``sample_index``, the :class:`~grimoire.contract.layout.Packed`
    layout), and ``completion_index [N, C]``: each completion token's position in that row."""
    keep = attention_mask.bool()
    # The samples' host-side lengths: one small copy here, where the batch is built, so no
    # forward or loss has to wait for one later.
    lens = keep.sum(-1).tolist()
    samples = [
        {"input_ids": i, "labels": t}
        for i, t in zip(input_ids[keep].split(lens), labels[keep].split(lens))
    ]
    where = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
    where[keep] = torch.arange(sum(lens), device=keep.device)
    return {**pack_samples(samples, 0), "completion_index": where[:, -completion_width:]}


def _token_logps_fn(
    model: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    completion_width: int,
    *,
    fused: bool,
    chunk_size: int,
) -> TokenLogpsFn:
    """The model call of :func:`batch_completion_logps`: per-token log-probs of the labels (the
    completion tokens) at ``temperature`` (module docstring).

    ``T == 1`` and packed rows go through :func:`~grimoire.forward.logprobs.compute_token_logps`
    (at ``T == 1`` its fused, memory-lean LM-head path; otherwise the full logits over ``T``);
    padded rows at other temperatures run the head on the positions that can hold a
    completion's prediction only: their last ``C + 1`` (completions are right-aligned after the
    left-padded prompts). Shapes: ``[B, T]`` in, ``[B, T]`` out (0 where there is no target);
    the entropy detached, a metric."""

    def compute(ids, labels, attention_mask, position_ids, layout=None) -> TokenLogps:
        if temperature == 1.0 or attention_mask is None:
            # A packed row (no mask: its samples lie along it) holds no padding to skip, so
            # every position goes through the head; this path also splits it across a
            # sequence group under sequence parallelism.
            return compute_token_logps(
                model,
                ids,
                labels,
                attention_mask,
                position_ids,
                fused=fused,
                chunk_size=chunk_size,
                return_entropy=with_entropy,
                temperature=temperature,
            )
        window = completion_width + 1
        logits = model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=window,
        ).logits
        logits = logits / temperature  # [B, K, V], the last K positions
        targets = shift_labels(labels, position_ids)[:, -logits.shape[1] :]
        valid = targets != IGNORE_INDEX
        logps = logps_from_logits(logits, targets.clamp(min=0)).masked_fill(~valid, 0.0)
        entropy = token_entropy(logits.detach()).masked_fill(~valid, 0.0) if with_entropy else None
        skipped = ids.shape[1] - logits.shape[1]  # positions before the window: no targets
        if entropy is not None:
            entropy = _left_pad(entropy, skipped)
        return TokenLogps(_left_pad(logps, skipped), _left_pad(valid, skipped), entropy)

    return compute


def _left_pad(t: Tensor, n: int) -> Tensor:
    """``[B, K]`` -> ``[B, n + K]``, the new columns zero / False."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], n)), t], 1)


def completion_rows(batch: dict[str, Any]) -> tuple[LayoutRows, Tensor]:
    """A completion batch's rows to score and ``completion_index [N, C]``: each completion
    token's position in the forward's output, flattened (-1 on padding). A packed batch holds
    both; padded rows (``input_ids``, ``attention_mask``, ``completion_mask``) get their labels
    and positions from the mask (counting real tokens, as generation did)."""
    layout = layout_of(batch)
    if isinstance(layout, Packed):
        return LayoutRows.of(batch), batch["completion_index"]
    ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    n, width = ids.shape
    c = batch["completion_mask"].shape[1]
    index = torch.arange(n, device=ids.device)[:, None] * width
    index = index + torch.arange(width - c, width, device=ids.device)[None, :]
    labels = padded_labels(ids, attention_mask, c)
    rows = LayoutRows(ids, labels, layout, attention_mask, position_ids_from_mask(attention_mask))
    return rows, index.masked_fill(attention_mask[:, -c:] == 0, -1)


def batch_completion_logps(
    model: torch.nn.Module,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool = False,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """``[N, C]`` completion log-probs of a completion batch, packed or padded, masked by its
    ``completion_mask``, and (``with_entropy``) the detached per-token entropy, same layout.

    One forward through :func:`grimoire.forward.batch.layout_token_logps` (the one dispatch on
    the layout), then one gather: completion token ``t`` of row ``i`` is predicted from the
    position before it (always the same sample's: the prompt comes first),
    ``completion_index[i, t] - 1`` of the forward's flattened output.
    """
    mask = batch["completion_mask"]
    compute = _token_logps_fn(
        model, temperature, with_entropy, mask.shape[1], fused=fused, chunk_size=chunk_size
    )
    rows, index = completion_rows(batch)
    out = rows.forward(compute)
    valid = index >= 0
    src = (index - 1).clamp(min=0)

    def gather(t: Tensor) -> Tensor:
        return t.reshape(-1)[src].masked_fill(~valid, 0.0)

    entropy = None if out.entropy is None else gather(out.entropy).detach()
    return gather(out.logps) * mask, entropy


def completion_logps(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_width: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """:func:`batch_completion_logps` of padded rows given as tensors: the last
    ``C = completion_width`` tokens of each ``[left-padded prompt | right-padded completion]``
    row, the completion part of ``attention_mask`` marking its real tokens (scored as one
    packed row under sequence parallelism, which splits only such rows).

    Shapes: ``input_ids, attention_mask [N, P + C]`` -> ``logps [N, C]`` float32 (0 on
    completion padding) and, if ``with_entropy``, the DETACHED per-token entropy ``[N, C]``.
    """
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": attention_mask[:, -completion_width:],
    }
    if sequence_group() is not None:  # sequence parallelism splits one packed row, not rows
        labels = padded_labels(input_ids, attention_mask, completion_width)
        packed = packed_columns(input_ids, attention_mask, labels, completion_width)
        batch = {"completion_mask": batch["completion_mask"], **packed}
    return batch_completion_logps(
        model, batch, temperature, with_entropy, fused=fused, chunk_size=chunk_size
    )


__all__ = [
    "TOKEN_COLUMNS",
    "batch_completion_logps",
    "completion_logps",
    "completion_rows",
    "packed_columns",
    "padded_labels",
    "position_ids_from_mask",
    "select_rows",
]
