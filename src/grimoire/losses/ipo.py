"""IPO: ``IPOLoss``, DPO's machinery with the squared-regression loss.

Azar et al., "A General Theoretical Paradigm to Understand Learning from Human Preferences",
arXiv 2310.12036. Math: :func:`grimoire.losses.functional.ipo_loss`, which is
:func:`~grimoire.losses.functional.dpo_loss` with ``loss_type="ipo"``.
"""

from __future__ import annotations

import torch

from grimoire.losses.dpo import DPOLoss


class IPOLoss(DPOLoss):
    """``loss = mean_B (h - 1 / (2 beta))^2`` with ``h`` the DPO log-ratio difference.

    Exactly ``DPOLoss(loss_type="ipo")``, defaults included: ``logp_reduction=None`` resolves to
    ``"mean"`` (TRL's convention: per-token averaged log-probs keep ``h`` O(1) and comparable
    across lengths, because the squared loss never saturates; see
    :func:`~grimoire.losses.functional.default_logp_reduction`); ``"sum"`` gives the paper's
    sequence-likelihood objective (re-tune ``beta`` for it). The reference options, metrics and
    weighting are those of :class:`DPOLoss`.
    """

    def __init__(
        self,
        beta: float = 0.1,
        ref_model: torch.nn.Module | None = None,
        logp_reduction: str | None = None,
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


__all__ = ["IPOLoss"]
