"""Model-facing machinery shared by the offline preference losses.

- :func:`pair_token_logps`: ONE forward over chosen and rejected stacked along the batch
  dimension (``[2B, T]``), so a DDP/FSDP-wrapped model is called once per micro-batch and the
  two halves see the same weights, dropout state and kernels.
- Reference log-probs come from :class:`grimoire.forward.reference.Reference` (cached columns, a frozen
  ``ref_model``, the LoRA base with adapters disabled, or an opt-in copy); :func:`pair_forward`
  with ``Reference.compute`` gives a pair's reference log-probs, padded or packed.
- :class:`PairwiseLoss`: the common base of the pairwise losses (columns, collator, weight);
  :class:`ReferenceLoss`: that of the methods scored against a reference (DPO, IPO, KTO).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.preference import PAIR_SIDES, PackedPairCollator, PreferenceCollator
from grimoire.config.context import TrainingContext
from grimoire.forward.batch import (
    TokenLogpsFn,
    rows_per_side,
    sides_token_logps,
    stack_rows,
    stacked_sides,
)
from grimoire.forward.logprobs import TokenLogps, compute_token_logps
from grimoire.forward.reference import (
    REDUCTION_COLUMN,
    Reference,
    is_peft_model,
    model_dtype,
    unwrap,
)
from grimoire.losses.base import TokenLogpsLoss
from grimoire.rows.preference import PREFERENCE_COLUMNS

logger = logging.getLogger(__name__)

LOGP_REDUCTIONS: tuple[str, ...] = ("sum", "mean")


def check_reduction(value: str, owner: str) -> str:
    if value not in LOGP_REDUCTIONS:
        raise ValueError(
            f"{owner}: logp_reduction must be one of {list(LOGP_REDUCTIONS)}, got {value!r}"
        )
    return value


def reduce_logps(logps: TokenLogps, reduction: str) -> Tensor:
    """Per-row sequence log-prob ``[B]``: summed, or averaged over the row's trained tokens."""
    return logps.sum() if reduction == "sum" else logps.mean()


#: grimoire-rl's flat metric names -> ours, for the same quantity (ORPO and KTO log both, so
#: dashboards built on grimoire-rl's names keep working).
PEER_METRIC_NAMES: dict[str, str] = {
    "chosen_rewards": "rewards/chosen",
    "rejected_rewards": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies",
    "kl_ref": "kl",
}


def with_peer_names(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """``metrics`` plus grimoire-rl's name for each of them that it has one for."""
    peers = {peer: metrics[ours] for peer, ours in PEER_METRIC_NAMES.items() if ours in metrics}
    return {**metrics, **peers}


def scalar_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-example ``[B]`` metrics -> detached float scalars (means over the micro-batch)."""
    return {k: v.detach().float().mean() for k, v in metrics.items()}


def pair_rows(batch: dict[str, Any], pad_value: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """A padded pair batch's ``[2B, T]`` input_ids / attention_mask / labels: chosen rows first,
    then rejected (:func:`grimoire.forward.batch.stacked_sides`)."""
    return stacked_sides(batch, PAIR_SIDES, pad_value)


def pair_forward(batch: dict[str, Any], compute: TokenLogpsFn) -> tuple[TokenLogps, TokenLogps]:
    """Chosen / rejected per-token log-probs ``[B, T]`` from one forward, padded or packed.

    ``compute(input_ids, labels, attention_mask, position_ids) -> TokenLogps``. The batch's
    layout decides the forward (:func:`grimoire.forward.batch.sides_token_logps`): padded pairs
    are stacked chosen over rejected (``[2B, T]``); a packed row (from
    :class:`PackedPairCollator`) holds the ``2B`` samples, chosen first, and is unpacked.
    """
    chosen, rejected = sides_token_logps(compute, batch, PAIR_SIDES)
    return chosen, rejected


def num_pairs(batch: dict[str, Any]) -> int:
    """The micro-batch's preference pairs, padded or packed."""
    return rows_per_side(batch, PAIR_SIDES)


def policy_compute(model: torch.nn.Module, *, fused: bool, chunk_size: int) -> TokenLogpsFn:
    """``compute(ids, labels, mask, position_ids, layout)`` for :func:`pair_forward` and the KTO
    parts: the model's per-token log-probs, with gradient."""

    def compute(ids, labels, mask, position_ids, layout=None):
        return compute_token_logps(
            model,
            ids,
            labels,
            attention_mask=mask,
            position_ids=position_ids,
            fused=fused,
            chunk_size=chunk_size,
            layout=layout,
        )

    return compute


def pair_token_logps(
    model: torch.nn.Module, batch: dict[str, Any], *, fused: bool, chunk_size: int
) -> tuple[TokenLogps, TokenLogps]:
    """Per-token log-probs of the chosen and rejected responses from one concatenated forward."""
    return pair_forward(batch, policy_compute(model, fused=fused, chunk_size=chunk_size))


class ReferenceLoss(TokenLogpsLoss):
    """Shared plumbing of the offline methods scored against a reference policy (DPO, IPO, KTO).

    The subclass's constructor sets ``self.reference`` (a :class:`~grimoire.forward.reference.Reference`)
    and ``self.logp_reduction``; ``setup`` places the reference and checks cached reference
    columns against that reduction.
    """

    needs_reference_model = True
    logp_reduction: str

    @property
    def frozen_reference(self) -> Reference:
        """``self.reference``, which every subclass's constructor sets."""
        assert self.reference is not None, f"{type(self).__name__} sets its reference in __init__"
        return self.reference

    @property
    def ref_model(self) -> torch.nn.Module | str | None:
        """The reference given at construction: a model, ``"copy"``, or None."""
        return self.frozen_reference.ref_model

    def setup(self, ctx: TrainingContext) -> None:
        self.frozen_reference.setup(ctx, self.logp_reduction)


class PairwiseLoss(TokenLogpsLoss):
    """Shared plumbing of the pairwise losses: columns, collator and one weight unit per pair."""

    required_columns = PREFERENCE_COLUMNS

    def policy_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[TokenLogps, TokenLogps]:
        return pair_token_logps(model, batch, fused=self.fused, chunk_size=self.fused_chunk_size)

    def create_collator(self, pad_token_id: int) -> PreferenceCollator:
        return PreferenceCollator(pad_token_id=pad_token_id)

    def create_packed_collator(self, pad_token_id: int) -> PackedPairCollator:
        return PackedPairCollator(pad_token_id)

    def loss_weight(self, batch: dict[str, Any]) -> float:
        """One unit per preference pair: the loss is a mean over pairs."""
        return float(num_pairs(batch))


def chosen_nll(chosen: TokenLogps) -> Tensor:
    """Token-mean NLL over all of the micro-batch's chosen tokens (CPO / ORPO's SFT term)."""
    return -chosen.logps.sum() / chosen.mask.sum().clamp(min=1)


__all__ = [
    "LOGP_REDUCTIONS",
    "REDUCTION_COLUMN",
    "PackedPairCollator",
    "PairwiseLoss",
    "ReferenceLoss",
    "check_reduction",
    "chosen_nll",
    "is_peft_model",
    "model_dtype",
    "num_pairs",
    "pair_forward",
    "pair_rows",
    "pair_token_logps",
    "policy_compute",
    "reduce_logps",
    "scalar_metrics",
    "stack_rows",
    "unwrap",
]
