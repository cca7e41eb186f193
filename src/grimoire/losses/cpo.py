"""CPO: ``CPOLoss``, reference-free DPO plus a behaviour-cloning NLL on the chosen responses.

Xu et al., "Contrastive Preference Optimization", arXiv 2401.08417. Math:
:func:`grimoire.losses.functional.cpo_loss` and :func:`~grimoire.losses.functional.cpo_total_loss`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.losses.checks import _check_weight
from grimoire.losses.dpo import DPOFamilyLoss
from grimoire.losses.functional import CPO_LOSS_TYPES, cpo_loss, cpo_total_loss
from grimoire.losses.preference import chosen_nll, reduce_logps, scalar_metrics


class CPOLoss(DPOFamilyLoss):
    """``loss = mean_B pref(beta (S_w - S_l)) + cpo_alpha * NLL(chosen)``.

    Args:
        beta: preference temperature (> 0).
        cpo_alpha: weight of the NLL term (TRL's ``cpo_alpha``; the paper uses 1).
        label_smoothing: cDPO-style smoothing for ``"sigmoid"``.
        loss_type: ``"sigmoid"`` (paper), ``"hinge"`` or ``"ipo"``.
        logp_reduction: default None: ``"sum"``, except ``"mean"`` for ``"ipo"`` (TRL; decided by
            :func:`~grimoire.losses.functional.default_logp_reduction`, as for DPO and IPO).

    ``NLL(chosen)`` is the token-mean NLL over all chosen tokens of the micro-batch (TRL). With
    gradient accumulation the trainer weights micro-batches by pairs, so that term is a
    pair-weighted mean of per-micro-batch token means (as in TRL). Metrics: ``rewards/*``
    (``beta * S``), ``logps/*``, ``nll_loss`` (TRL's name). ``loss_weight`` = pairs.
    """

    loss_types = CPO_LOSS_TYPES

    def __init__(
        self,
        beta: float = 0.1,
        cpo_alpha: float = 1.0,
        label_smoothing: float = 0.0,
        loss_type: str = "sigmoid",
        logp_reduction: str | None = None,
        fused: bool = True,
        fused_chunk_size: int = 1024,
    ):
        super().__init__(beta, label_smoothing, loss_type, logp_reduction, fused, fused_chunk_size)
        _check_weight(cpo_alpha, "cpo_alpha")
        self.cpo_alpha = cpo_alpha

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        chosen, rejected = self.policy_logps(model, batch)
        pref, metrics = cpo_loss(
            reduce_logps(chosen, self.logp_reduction),
            reduce_logps(rejected, self.logp_reduction),
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        nll = chosen_nll(chosen)
        loss = cpo_total_loss(pref, nll, alpha=self.cpo_alpha).mean()
        out = scalar_metrics(metrics)
        out["nll_loss"] = nll.detach()  # TRL's CPOTrainer name
        return loss, out


__all__ = ["CPOLoss"]
