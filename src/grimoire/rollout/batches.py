"""Rollout plumbing: sampled completions -> the training micro-batches online losses consume.

Two layouts of the same rows, so the loss code is shared:

- padded: ``input_ids / attention_mask [N, P + C]`` (left-padded prompt, right-padded
  completion) with per-token tensors (``completion_mask``, ``old_logps``, ``sampler_logps``,
  ``ref_logps``) in the ``[N, C]`` completion layout;
- packed (:func:`pack_rollout_batch`, when the run is padding-free or has a token budget): one
  ``[1, L]`` row of the real prompt+completion tokens; per-token tensors keep the ``[N, C]``
  layout and ``completion_index`` maps them into the row, so
  :func:`packed_completion_logps` returns log-probs laid out exactly like the padded path's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.prompts import prompt_token_lists
from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import LAYOUT_KEY, Packed, Padded, layout_of
from grimoire.forward.logprobs import compute_token_logps, logps_from_logits, token_entropy
from grimoire.rollout.engine import Rollout, completion_logps


def training_batch(rollout: Rollout, rows: Sequence[int], pack: bool) -> dict[str, Any]:
    """The training batch of ``rows`` of ``rollout`` (completion width trimmed to fit).

    No rows (every group dropped, no pair formed) -> one row with an all-zero
    ``completion_mask``: loss 0 and 0 loss units, yet a forward/backward runs, as every rank
    must for DDP to stay in step.
    """
    keep = list(rows) or [0]
    idx = torch.tensor(keep, device=rollout.completion_ids.device)
    cmask = rollout.completion_mask[idx]
    width = max(1, int(cmask.sum(-1).max()))
    batch = {
        "input_ids": torch.cat([rollout.prompt_ids[idx], rollout.completion_ids[idx, :width]], 1),
        "attention_mask": torch.cat([rollout.prompt_mask[idx], cmask[:, :width]], 1),
        "completion_mask": (cmask if rows else torch.zeros_like(cmask))[:, :width],
        LAYOUT_KEY: Padded(),
    }
    if rollout.old_logps is not None:
        batch["old_logps"] = rollout.old_logps[idx, :width]
    if rollout.sampler_logps is not None:
        batch["sampler_logps"] = rollout.sampler_logps[idx, :width]
    return pack_rollout_batch(batch) if pack else batch


def placeholder_batch(prompts: dict[str, Any], pad_token_id: int, pack: bool) -> dict[str, Any]:
    """A rank-sync dummy's training batch, built WITHOUT sampling: the first prompt and one pad
    token as its "completion", masked out (loss 0, 0 loss units). Zero ``advantages`` /
    ``ref_logps`` and ``num_pairs = 0`` stand in for every method's per-row inputs."""
    prompt = prompt_token_lists(prompts)[0]
    device = prompts["prompt_input_ids"].device
    ids = torch.tensor([[*prompt, pad_token_id]], device=device)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": torch.zeros((1, 1), dtype=torch.long, device=device),
        "advantages": torch.zeros(1, device=device),
        "ref_logps": torch.zeros((1, 1), device=device),
        "num_pairs": 0,
        LAYOUT_KEY: Padded(),
    }
    return pack_rollout_batch(batch) if pack else batch


def pack_rollout_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A padded training batch (``[N, P + C]`` rows: left-padded prompt, right-padded completion)
    as ONE packed row of its ``N`` real prompt+completion samples.

    Only ``input_ids`` / ``attention_mask`` change (to ``input_ids``, ``labels``,
    ``position_ids``, ``sample_index`` as from :func:`grimoire.collate.packing.pack_samples`)
    and the layout becomes :class:`~grimoire.contract.layout.Packed` (the samples' host-side
    lengths); the per-token tensors (``completion_mask``, ``old_logps``, advantages, reference
    log-probs) keep their padded ``[N, C]`` completion layout, and ``completion_index [N, C]``
    (each completion token's position in the packed row, -1 on padding) lets
    :func:`packed_completion_logps` return log-probs in that same layout.
    Positions restart at 0 per sample: exactly the padded path's ``cumsum(attention_mask) - 1``
    at real tokens.
    """
    keep = batch["attention_mask"].bool()
    c = batch["completion_mask"].shape[1]
    device = keep.device
    ids = batch["input_ids"][keep]  # row-major: the samples back to back
    lens = keep.sum(-1)
    # The layout's host-side lengths: one small copy here, where the batch is built (boolean
    # indexing above has synced already), so no forward or loss has to wait for one later.
    seq_lens = tuple(lens.tolist())
    where = torch.full(keep.shape, -1, dtype=torch.long, device=device)
    where[keep] = torch.arange(ids.numel(), device=device)
    is_completion = torch.zeros_like(keep)
    is_completion[:, -c:] = True
    labels = batch["input_ids"].masked_fill(~is_completion, IGNORE_INDEX)[keep]
    sample_index = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    position_ids = torch.arange(ids.numel(), device=device) - starts[sample_index]
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    out.update(
        input_ids=ids[None],
        labels=labels[None],
        position_ids=position_ids[None],
        sample_index=sample_index[None],
        completion_index=where[:, -c:],
    )
    out[LAYOUT_KEY] = Packed(seq_lens)
    return out


def packed_completion_logps(
    model: torch.nn.Module,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool = False,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """:func:`~grimoire.rollout.engine.completion_logps` for a :func:`pack_rollout_batch` batch:
    ``[N, C]`` completion log-probs (0 on padding) and the detached entropy, same layout."""
    index = batch["completion_index"]
    valid = index >= 0
    # A completion token is predicted from the position before it (always the same sample's:
    # the prompt comes first), so gather from there.
    src = (index - 1).clamp(min=0)
    ids, pos = batch["input_ids"], batch["position_ids"]
    if temperature == 1.0:
        out = compute_token_logps(
            model,
            ids,
            batch["labels"],
            position_ids=pos,
            fused=fused,
            chunk_size=chunk_size,
            return_entropy=with_entropy,
        )
        logps = out.logps[0][src]
        entropy = out.entropy[0][src].detach() if with_entropy else None
    else:
        # No logits_to_keep: completions are spread along the row, so the head runs on it all.
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logits = logits[src] / temperature  # [N, C, V]
        logps = logps_from_logits(logits, ids[0][index.clamp(min=0)])
        entropy = token_entropy(logits.detach()) if with_entropy else None
    return logps.masked_fill(~valid, 0.0), entropy


def batch_completion_logps(
    model: torch.nn.Module,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool = False,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """``[N, C]`` completion log-probs of a training batch, packed or padded, masked.

    Dispatches on the batch's layout rather than through
    :func:`grimoire.forward.batch.sample_token_logps`: the result is in the ``[N, C]``
    completion layout (left-padded prompts in the padded rows), with the sampling temperature
    applied to the logits, not per-sample rows of label log-probs.
    """
    if isinstance(layout_of(batch), Packed):
        logps, entropy = packed_completion_logps(
            model, batch, temperature, with_entropy, fused=fused, chunk_size=chunk_size
        )
    else:
        c = batch["completion_mask"].shape[1]
        logps, entropy = completion_logps(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            c,
            temperature,
            with_entropy,
            fused=fused,
            chunk_size=chunk_size,
        )
    return logps * batch["completion_mask"], entropy


__all__ = [
    "batch_completion_logps",
    "pack_rollout_batch",
    "packed_completion_logps",
    "placeholder_batch",
    "training_batch",
]
