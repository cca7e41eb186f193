"""Rollout plumbing: sampled completions -> the training micro-batches online losses consume.

Two layouts of the same rows, so the loss code is shared:

- padded: ``input_ids / attention_mask [N, P + C]`` (left-padded prompt, right-padded
  completion);
- packed (when the run is padding-free or has a token budget): the real prompt+completion
  tokens of the ``N`` rows as ONE ``[1, L]`` row, packed by
  :func:`grimoire.collate.packing.pack_samples` like every other packed batch.

Either way the per-token tensors (``completion_mask``, ``old_logps``, ``sampler_logps``,
``ref_logps``) keep the ``[N, C]`` completion layout; a packed batch's ``completion_index
[N, C]`` says where each completion token sits in its row (``-1`` on padding).
:func:`batch_completion_logps` runs the forward through the one dispatch on the layout
(:func:`grimoire.forward.batch.layout_token_logps`) and reads both layouts' results with one
gather (:func:`completion_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.packing import pack_samples
from grimoire.collate.prompts import prompt_token_lists
from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Packed, Padded, layout_of, shift_labels
from grimoire.forward.batch import LayoutRows, TokenLogpsFn
from grimoire.forward.logprobs import (
    TokenLogps,
    compute_token_logps,
    logps_from_logits,
    token_entropy,
)
from grimoire.rollout.engines.base import Rollout, position_ids_from_mask


def training_batch(rollout: Rollout, rows: Sequence[int], pack: bool) -> dict[str, Any]:
    """The training batch of ``rows`` of ``rollout`` (completion width trimmed to fit).

    No rows (every group dropped, no pair formed) -> one row with an all-zero
    ``completion_mask``: loss 0 and 0 loss units, yet a forward/backward runs, as every rank
    must for DDP to stay in step.
    """
    keep = list(rows) or [0]
    idx = torch.tensor(keep, device=rollout.completion_ids.device)
    cmask = rollout.completion_mask[idx]
    # The attention (every real token: an episode's tool results too) sets the width; the loss
    # mask stays ``completion_mask``.
    attended = rollout.completion_attended[idx]
    width = max(1, int(attended.sum(-1).max()))
    batch = {"completion_mask": (cmask if rows else torch.zeros_like(cmask))[:, :width]}
    if rollout.old_logps is not None:
        batch["old_logps"] = rollout.old_logps[idx, :width]
    if rollout.sampler_logps is not None:
        batch["sampler_logps"] = rollout.sampler_logps[idx, :width]
    ids = torch.cat([rollout.prompt_ids[idx], rollout.completion_ids[idx, :width]], 1)
    attention_mask = torch.cat([rollout.prompt_mask[idx], attended[:, :width]], 1)
    return with_token_columns(batch, ids, attention_mask, pack)


def placeholder_batch(prompts: dict[str, Any], pad_token_id: int, pack: bool) -> dict[str, Any]:
    """A rank-sync dummy's training batch, built WITHOUT sampling: the first prompt and one pad
    token as its "completion", masked out (loss 0, 0 loss units). Zero ``advantages`` /
    ``ref_logps`` and ``num_pairs = 0`` stand in for every method's per-row inputs."""
    prompt = prompt_token_lists(prompts)[0]
    device = prompts["prompt_input_ids"].device
    ids = torch.tensor([[*prompt, pad_token_id]], device=device)
    batch = {
        "completion_mask": torch.zeros((1, 1), dtype=torch.long, device=device),
        "advantages": torch.zeros(1, device=device),
        "ref_logps": torch.zeros((1, 1), device=device),
        "num_pairs": 0,
    }
    return with_token_columns(batch, ids, torch.ones_like(ids), pack)


def with_token_columns(
    batch: dict[str, Any], input_ids: Tensor, attention_mask: Tensor, pack: bool
) -> dict[str, Any]:
    """``batch`` (its ``[N, C]`` per-token columns, ``completion_mask`` first) with the token
    columns of the rows ``input_ids / attention_mask [N, P + C]`` (left-padded prompt,
    right-padded completion), padded or packed, and its layout (see the module docstring)."""
    if not pack:
        rows = {"input_ids": input_ids, "attention_mask": attention_mask}
        return {**batch, **rows, LAYOUT_KEY: Padded(rows=input_ids.shape[0])}
    c = batch["completion_mask"].shape[1]
    labels = padded_labels(input_ids, attention_mask, c)
    return {**batch, **packed_columns(input_ids, attention_mask, labels, c)}


def padded_labels(input_ids: Tensor, attention_mask: Tensor, completion_width: int) -> Tensor:
    """The targets of ``[N, P + C]`` rows: their real completion tokens, -100 elsewhere."""
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :-completion_width] = IGNORE_INDEX
    return labels


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


def pack_rollout_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A padded training batch as ONE packed row of its ``N`` real prompt+completion samples
    (see the module docstring); the per-token ``[N, C]`` columns are kept as they are.
    Positions restart at 0 per sample: exactly the padded path's ``cumsum(attention_mask) - 1``
    at real tokens."""
    rest = dict(batch)
    for key in ("input_ids", "attention_mask", "labels", "position_ids", "completion_index"):
        rest.pop(key, None)  # rebuilt below from the rows and their mask
    return with_token_columns(rest, batch["input_ids"], batch["attention_mask"], pack=True)


def completion_compute(
    model: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    completion_width: int,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> TokenLogpsFn:
    """The model call for :func:`batch_completion_logps`: per-token log-probs of the labels
    (the completion tokens) with the logits divided by ``temperature``, so the log-probs are
    those of the distribution that was sampled (PPO's ratio must compare like with like; TRL
    does the same)::

        logps[t] = log softmax(logits[t] / T)[labels[t + 1]]

    ``T == 1`` goes through :func:`~grimoire.forward.logprobs.compute_token_logps` (its fused,
    memory-lean LM-head path); other temperatures run the head on the positions that can hold a
    completion's prediction: the last ``C + 1`` of padded rows (completions are right-aligned
    after the left-padded prompts), all of a packed row. Shapes: ``[B, T]`` in, ``[B, T]``
    out (0 where there is no target); the entropy detached, a metric."""

    def compute(ids, labels, attention_mask, position_ids, layout=None) -> TokenLogps:
        if temperature == 1.0:
            return compute_token_logps(
                model,
                ids,
                labels,
                attention_mask,
                position_ids,
                fused=fused,
                chunk_size=chunk_size,
                return_entropy=with_entropy,
            )
        # Padded rows come with their mask (a packed row without: its samples lie along it).
        window = completion_width + 1 if attention_mask is not None else 0
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
    """A training batch's rows to score and ``completion_index [N, C]``: each completion
    token's position in the forward's output, flattened (-1 on padding). A packed batch holds
    both; padded rows (as built here, or by hand: ``input_ids``, ``attention_mask``,
    ``completion_mask``) get their labels and positions from the mask (counting real tokens,
    as generation did)."""
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
    """``[N, C]`` completion log-probs of a training batch, packed or padded, masked by its
    ``completion_mask``, and (``with_entropy``) the detached per-token entropy, same layout.

    One forward through :func:`grimoire.forward.batch.layout_token_logps` (the one dispatch on
    the layout) with :func:`completion_compute`, then one gather: completion token ``t`` of
    row ``i`` is predicted from the position before it (always the same sample's: the prompt
    comes first), ``completion_index[i, t] - 1`` of the forward's flattened output.
    """
    mask = batch["completion_mask"]
    compute = completion_compute(
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


__all__ = [
    "batch_completion_logps",
    "completion_compute",
    "pack_rollout_batch",
    "packed_columns",
    "placeholder_batch",
    "training_batch",
    "with_token_columns",
]
