"""Rollout plumbing: sampled completions -> the training micro-batches online losses consume.

Two layouts of the same rows (the completion batches of :mod:`grimoire.forward.completions`,
which scores either):

- padded: ``input_ids / attention_mask [N, P + C]`` (left-padded prompt, right-padded
  completion);
- packed (when the run is padding-free or has a token budget): the real prompt+completion
  tokens of the ``N`` rows as ONE ``[1, L]`` row, packed by
  :func:`grimoire.collate.packing.pack_samples` like every other packed batch.

Either way the per-token tensors (``completion_mask``, ``old_logps``, ``sampler_logps``,
``ref_logps``) keep the ``[N, C]`` completion layout; a packed batch's ``completion_index
[N, C]`` says where each completion token sits in its row (``-1`` on padding).

The rollout stage builds each scored group's padded batch here (:func:`training_batch` of every
row), a method selects rows of it, and the stage packs the selections when the run is packed
(:func:`pack_rollout_batch`): the method never builds a batch's layout itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.prompts import prompt_token_lists
from grimoire.contract.layout import LAYOUT_KEY, Padded
from grimoire.forward.completions import packed_columns, padded_labels, select_rows
from grimoire.rollout.engines.base import Rollout


def training_batch(rollout: Rollout, rows: Sequence[int], pack: bool) -> dict[str, Any]:
    """The training batch of ``rows`` of ``rollout``, packed or padded: their
    :func:`~grimoire.forward.completions.select_rows` (completion width trimmed to fit; no rows:
    row 0, masked out) of the rollout's padded rows."""
    batch = {"completion_mask": rollout.completion_mask}
    if rollout.old_logps is not None:
        batch["old_logps"] = rollout.old_logps
    if rollout.sampler_logps is not None:
        batch["sampler_logps"] = rollout.sampler_logps
    rows_of = {**batch, "input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask}
    selected = select_rows(rows_of, rows)
    return pack_rollout_batch(selected) if pack else selected


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


def pack_rollout_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A padded training batch as ONE packed row of its ``N`` real prompt+completion samples
    (see the module docstring); the per-token ``[N, C]`` columns are kept as they are.
    Positions restart at 0 per sample: exactly the padded path's ``cumsum(attention_mask) - 1``
    at real tokens."""
    rest = dict(batch)
    for key in ("input_ids", "attention_mask", "labels", "position_ids", "completion_index"):
        rest.pop(key, None)  # rebuilt below from the rows and their mask
    return with_token_columns(rest, batch["input_ids"], batch["attention_mask"], pack=True)


__all__ = [
    "pack_rollout_batch",
    "placeholder_batch",
    "training_batch",
    "with_token_columns",
]
