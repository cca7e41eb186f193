"""ORPO: ``ORPOLoss``, SFT plus an odds-ratio preference term, no reference model.

Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
arXiv 2403.07691. Math: :func:`grimoire.losses.functional.orpo_loss`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.losses.checks import _check_beta
from grimoire.losses.functional import orpo_loss
from grimoire.losses.preference import (
    PairwiseLoss,
    chosen_nll,
    scalar_metrics,
    with_peer_names,
)


class ORPOLoss(PairwiseLoss):
    """``loss = NLL(chosen) - beta * mean_B log sigma(log odds(y_w) - log odds(y_l))``.

    ``NLL(chosen)`` is the token-mean NLL over the micro-batch's chosen tokens; the odds use
    per-token AVERAGED log-probs (``p = exp(A)`` must be a per-token probability for ``1 - p`` to
    mean anything), so there is no ``logp_reduction`` option. ``beta`` is the paper's lambda.

    Metrics (scalar means): ``rewards/*`` (``beta * A``), ``logps/*`` (averages), ``nll_loss``,
    ``or_loss`` (the odds-ratio term ``-beta * mean log sigma(LOR)``, so ``loss = nll_loss +
    or_loss``; grimoire-rl's name), ``log_odds_ratio`` (``log sigma(LOR)``, TRL's name),
    ``log_odds_chosen`` (``LOR``).
    ``loss_weight`` = pairs.
    """

    def __init__(self, beta: float = 0.1, fused: bool = True, fused_chunk_size: int = 1024):
        super().__init__(fused=fused, fused_chunk_size=fused_chunk_size)
        _check_beta(beta)
        self.beta = beta

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        chosen, rejected = self.policy_logps(model, batch)
        odds_losses, metrics = orpo_loss(chosen.mean(), rejected.mean(), beta=self.beta)
        nll = chosen_nll(chosen)
        or_loss = odds_losses.mean()
        loss = nll.float() + or_loss
        out = scalar_metrics(metrics)
        out["nll_loss"] = nll.detach()  # TRL's ORPOTrainer name
        out["or_loss"] = or_loss.detach()  # the odds-ratio term; grimoire-rl's name
        return loss, with_peer_names(out)


__all__ = ["ORPOLoss"]
