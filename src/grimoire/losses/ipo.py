"""IPO: ``IPOLoss``, DPO's machinery with the squared-regression loss.

Azar et al., "A General Theoretical Paradigm to Understand Learning from Human Preferences",
arXiv 2310.12036. Math: :func:`grimoire.losses.functional.ipo_loss`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dpo import DPOLoss
from .functional import ipo_loss


class IPOLoss(DPOLoss):
    """``loss = mean_B (h - 1 / (2 beta))^2`` with ``h`` the DPO log-ratio difference.

    ``logp_reduction="mean"`` by default (TRL's convention: per-token averaged log-probs keep
    ``h`` O(1) and comparable across lengths, because the squared loss never saturates);
    ``"sum"`` gives the paper's sequence-likelihood objective (re-tune ``beta`` for it). The
    reference options, metrics and weighting are those of :class:`DPOLoss`.
    """

    def __init__(
        self,
        beta: float = 0.1,
        ref_model: torch.nn.Module | None = None,
        logp_reduction: str = "mean",
        fused: bool = True,
        fused_chunk_size: int = 1024,
    ):
        super().__init__(
            beta=beta,
            ref_model=ref_model,
            loss_type="ipo",
            logp_reduction=logp_reduction,
            fused=fused,
            fused_chunk_size=fused_chunk_size,
        )

    def pair_losses(
        self, pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return ipo_loss(pc, pr, rc, rr, beta=self.beta)


__all__ = ["IPOLoss"]
