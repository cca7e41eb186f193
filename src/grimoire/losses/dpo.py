"""DPO (and its cDPO / SLiC hinge / rDPO variants): ``DPOLoss``.

Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290. The math is
:func:`grimoire.losses.functional.dpo_loss`; this class computes the policy log-probs with one
concatenated chosen+rejected forward and gets the reference log-probs from a cache, a frozen
``ref_model``, or the LoRA policy with adapters disabled (see :mod:`.preference`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .checks import _check_beta, _check_loss_type
from .functional import DPO_LOSS_TYPES, default_logp_reduction, dpo_loss
from .preference import (
    PairwiseLoss,
    ReferenceLogps,
    check_reduction,
    reduce_logps,
    scalar_metrics,
)

REF_PAIR_COLUMNS: tuple[str, str] = ("ref_chosen_logps", "ref_rejected_logps")


def check_loss_type_args(
    owner: str,
    beta: float,
    loss_type: str,
    allowed: tuple[str, ...],
    label_smoothing: float,
    logp_reduction: str | None,
) -> str:
    """Constructor checks of the ``loss_type`` families (DPO, IPO, CPO), so a bad setting fails
    at construction rather than at the first step. Returns the log-prob reduction to use:
    ``logp_reduction``, or when None the loss type's default
    (:func:`~grimoire.losses.functional.default_logp_reduction`)."""
    _check_beta(beta)
    _check_loss_type(loss_type, allowed, label_smoothing)
    if logp_reduction is None:
        logp_reduction = default_logp_reduction(loss_type)
    return check_reduction(logp_reduction, owner)


class DPOLoss(PairwiseLoss):
    """Direct Preference Optimization against a frozen reference policy.

    Args:
        beta: KL-penalty strength (> 0); rewards are ``beta * (log pi - log pi_ref)``.
        ref_model: a frozen reference model. Optional when the policy is trained with LoRA (the
            base model with adapters disabled is the reference) or when the datasets carry
            cached ``ref_chosen_logps``/``ref_rejected_logps`` columns; without any of the three
            the trainer's ``setup`` raises a ``ConfigError``.
        label_smoothing: assumed label-flip rate for ``"sigmoid"`` (cDPO) and ``"robust"`` (rDPO).
        loss_type: ``"sigmoid"`` (DPO), ``"hinge"`` (SLiC), ``"ipo"`` or ``"robust"``.
        logp_reduction: ``"sum"`` (the paper's sequence log-likelihood) or ``"mean"`` (per-token
            average). Default None: :func:`~grimoire.losses.functional.default_logp_reduction`,
            i.e. ``"sum"``, except ``"mean"`` for ``"ipo"`` (TRL), so ``DPOLoss(loss_type="ipo")``
            is exactly :class:`~grimoire.losses.ipo.IPOLoss`.
        fused, fused_chunk_size: passed to :func:`grimoire.logprobs.compute_token_logps`.

    Loss: the mean over the micro-batch's pairs (``loss_weight`` = pairs). Metrics (scalar
    means): ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (policy, reduced as above).
    """

    needs_reference_model = True

    def __init__(
        self,
        beta: float = 0.1,
        ref_model: torch.nn.Module | None = None,
        label_smoothing: float = 0.0,
        loss_type: str = "sigmoid",
        logp_reduction: str | None = None,
        fused: bool = True,
        fused_chunk_size: int = 1024,
    ):
        super().__init__(fused=fused, fused_chunk_size=fused_chunk_size)
        name = type(self).__name__
        self.logp_reduction = check_loss_type_args(
            name, beta, loss_type, DPO_LOSS_TYPES, label_smoothing, logp_reduction
        )
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.loss_type = loss_type
        self.reference = ReferenceLogps(ref_model, name, REF_PAIR_COLUMNS)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.reference.ref_model

    def setup(self, trainer: Any) -> None:
        self.reference.setup(trainer, self.logp_reduction)

    def reference_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """``[B]`` reference log-probs of chosen and rejected: cached, or one no-grad forward."""
        cached = self.reference.cached(batch, self.logp_reduction)
        if cached is not None:
            return cached[0], cached[1]
        chosen, rejected = self.reference.pair_logps(
            model, batch, fused=self.fused, chunk_size=self.fused_chunk_size
        )
        return reduce_logps(chosen, self.logp_reduction), reduce_logps(
            rejected, self.logp_reduction
        )

    def pair_losses(
        self, pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return dpo_loss(
            pc,
            pr,
            rc,
            rr,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        chosen, rejected = self.policy_logps(model, batch)
        pc = reduce_logps(chosen, self.logp_reduction)
        pr = reduce_logps(rejected, self.logp_reduction)
        rc, rr = self.reference_logps(model, batch)
        losses, metrics = self.pair_losses(pc, pr, rc.to(pc.device), rr.to(pc.device))
        return losses.mean(), scalar_metrics(metrics)


__all__ = ["REF_PAIR_COLUMNS", "DPOLoss", "check_loss_type_args"]
