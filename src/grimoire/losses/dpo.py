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

from grimoire.forward.reference import Reference
from grimoire.losses.checks import _check_beta, _check_loss_type
from grimoire.losses.functional import DPO_LOSS_TYPES, default_logp_reduction, dpo_loss
from grimoire.losses.preference import (
    PairwiseLoss,
    ReferenceLoss,
    check_reduction,
    pair_forward,
    reduce_logps,
    scalar_metrics,
)

REF_PAIR_COLUMNS: tuple[str, str] = ("ref_chosen_logps", "ref_rejected_logps")


class DPOFamilyLoss(PairwiseLoss):
    """Base of the pairwise losses with a ``loss_type`` (DPO, IPO, CPO): their shared options,
    checked at construction so a bad setting fails there rather than at the first step.

    ``self.logp_reduction`` is ``logp_reduction``, or when None the loss type's default
    (:func:`~grimoire.losses.functional.default_logp_reduction`).
    """

    #: The ``loss_type`` values the method accepts (CPO narrows them).
    loss_types: tuple[str, ...] = DPO_LOSS_TYPES

    def __init__(
        self,
        beta: float,
        label_smoothing: float,
        loss_type: str,
        logp_reduction: str | None,
        fused: bool,
        fused_chunk_size: int,
    ):
        super().__init__(fused=fused, fused_chunk_size=fused_chunk_size)
        _check_beta(beta)
        _check_loss_type(loss_type, self.loss_types, label_smoothing)
        if logp_reduction is None:
            logp_reduction = default_logp_reduction(loss_type)
        self.logp_reduction = check_reduction(logp_reduction, type(self).__name__)
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.loss_type = loss_type


class DPOLoss(ReferenceLoss, DPOFamilyLoss):
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
        fused, fused_chunk_size: passed to :func:`grimoire.forward.logprobs.compute_token_logps`.

    Loss: the mean over the micro-batch's pairs (``loss_weight`` = pairs). Metrics (scalar
    means): ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (policy, reduced as above).
    """

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
        self.reference = Reference(ref_model, type(self).__name__, REF_PAIR_COLUMNS)
        super().__init__(beta, label_smoothing, loss_type, logp_reduction, fused, fused_chunk_size)

    def reference_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """``[B]`` reference log-probs of chosen and rejected: cached, or one no-grad forward."""
        cached = self.frozen_reference.cached(batch, self.logp_reduction)
        if cached is not None:
            return cached[0], cached[1]
        compute = self.frozen_reference.compute(
            model, fused=self.fused, chunk_size=self.fused_chunk_size
        )
        chosen, rejected = pair_forward(batch, compute)
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


__all__ = ["REF_PAIR_COLUMNS", "DPOFamilyLoss", "DPOLoss"]
