"""Loss units: how much each micro-batch weighs in the step's objective, and the gradient scale.

A method's loss is a mean over its loss units (tokens for SFT, pairs for DPO, ...). The step
back-propagates each micro-batch's mean loss times its units over a normaliser that is the same
on every rank without a collective (:func:`backward_norm`); after the step's one all-reduce the
gradients are rescaled (:func:`gradient_scale`) so the step optimises the mean over every loss
unit of the global batch, however the batch was split over micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grimoire.contract.layout import num_tokens
from grimoire.contract.method import Method


def count_tokens(batch: Mapping[str, Any]) -> float:
    """Real (non-pad) input tokens in a collated batch (:func:`~grimoire.contract.layout.num_tokens`:
    the collator's host-side count when its layout has one, nothing read from the tensors)."""
    return float(num_tokens(batch))


def loss_units(method: Method, batch: dict[str, Any]) -> float:
    """The method's loss units in ``batch`` (its ``loss_weight``)."""
    return float(method.loss_weight(batch))


def backward_norm(loss_units_seen: float, steps: int, world_size: int) -> float:
    """The normaliser of this step's backward passes: the run's mean loss units per step and
    rank so far (1 on the first step).

    It is the same on every rank and survives a resume (it is read from the trainer state), so it
    needs no collective before the backward passes, and keeps gradients at a mean's scale (no
    fp16 overflow). The exact global normaliser is applied after the step's reduction.
    """
    if steps and loss_units_seen > 0:
        return loss_units_seen / steps / world_size
    return 1.0


def backward_scale(units: float, norm: float) -> float:
    """What one micro-batch's mean loss is multiplied by before its backward pass."""
    return units / norm if norm > 0 else 0.0


def gradient_scale(norm: float, world_size: int, global_units: float) -> float:
    """The factor that turns the accumulated gradients into the mean over every loss unit.

    DDP averaged the ranks' gradients: ``(1/W) sum_r sum_i w_i grad_i / norm``; times
    ``norm * W / U`` that is the mean over every loss unit ``U`` of the global batch.
    """
    return norm * world_size / global_units if global_units > 0 else 0.0


__all__ = ["backward_norm", "backward_scale", "count_tokens", "gradient_scale", "loss_units"]
