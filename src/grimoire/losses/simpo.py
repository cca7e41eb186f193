"""SimPO: ``SimPOLoss``, reference-free and length-normalised.

Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
arXiv 2405.14734. Math: :func:`grimoire.losses.functional.simpo_loss`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.losses.checks import _check_beta, _check_label_smoothing
from grimoire.losses.functional import simpo_loss
from grimoire.losses.preference import PairwiseLoss, scalar_metrics


class SimPOLoss(PairwiseLoss):
    """``loss = mean_B -log sigma(beta (A_w - A_l) - gamma)`` (label-smoothed when asked).

    Always uses per-token AVERAGED log-probs: the average is SimPO's reward and what removes the
    length bias without a reference model (SimPO on sums is reference-free DPO, i.e.
    ``CPOLoss(cpo_alpha=0)``). ``gamma`` is the absolute target margin; convert the authors'
    ``gamma_beta_ratio`` configs with ``gamma = gamma_beta_ratio * beta``.

    Metrics (scalar means): ``rewards/*`` (``beta * A``), ``logps/chosen``, ``logps/rejected``
    (averages). ``loss_weight`` = pairs.
    """

    def __init__(
        self,
        beta: float = 2.0,
        gamma: float = 0.5,
        label_smoothing: float = 0.0,
        fused: bool = True,
        fused_chunk_size: int = 1024,
    ):
        super().__init__(fused=fused, fused_chunk_size=fused_chunk_size)
        _check_beta(beta)
        _check_label_smoothing(label_smoothing)
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        chosen, rejected = self.policy_logps(model, batch)
        losses, metrics = simpo_loss(
            chosen.mean(),
            rejected.mean(),
            beta=self.beta,
            gamma=self.gamma,
            label_smoothing=self.label_smoothing,
        )
        return losses.mean(), scalar_metrics(metrics)


__all__ = ["SimPOLoss"]
