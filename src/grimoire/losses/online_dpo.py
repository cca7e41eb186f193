"""Online DPO: DPO on preference pairs the current policy samples and the reward ranks.

Paper: Guo et al., "Direct Language Model Alignment from Online AI Feedback" (OAIF),
arXiv 2402.04792. Per prompt, sample ``G >= 2`` completions, score them with the reward
functions, and pair the best with the worst (ties: no preference, skipped). Then the DPO loss
(:func:`grimoire.losses.functional.dpo_loss`, Rafailov et al., arXiv 2305.18290) against the
frozen reference on SUMMED sequence log-probs::

    h    = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
    loss = -log sigma(beta h)                       (loss_type="sigmoid")

Log-probs are at temperature 1 (the model's own likelihood, as offline DPO). Loss weight: one
unit per pair, so the trainer's global normalisation averages over every pair of the global
batch; a micro-batch whose groups are all ties has weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.losses.checks import _check_loss_type
from grimoire.losses.functional import DPO_LOSS_TYPES, dpo_loss
from grimoire.losses.online import OnlineMethod
from grimoire.losses.online_functional import best_worst_pairs
from grimoire.losses.sampler_correction import CORRECTION_ARGS
from grimoire.rollout.rewards.calls import RewardSpec
from grimoire.rollout.stage import ScoredGroup

_DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


class OnlineDPOMethod(OnlineMethod):
    """Online DPO (see the module docstring). ``beta`` is DPO's beta (> 0, default 0.1);
    ``loss_type`` any of :data:`~grimoire.losses.functional.DPO_LOSS_TYPES`."""

    #: A likelihood loss on the chosen completions: no sampler correction (docs/online-rl.md).
    hidden_args = CORRECTION_ARGS

    def __init__(
        self,
        reward_funcs: RewardSpec | Sequence[RewardSpec],
        num_generations: int = 2,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        log_entropy: bool = False,
        **kwargs: Any,
    ):
        if not beta > 0:
            raise ValueError(f"OnlineDPOMethod: beta must be > 0 (DPO's temperature), got {beta}")
        _check_loss_type(loss_type, DPO_LOSS_TYPES, label_smoothing)  # as DPOLoss does
        super().__init__(
            reward_funcs,
            num_generations=num_generations,
            beta=beta,
            log_entropy=log_entropy,
            **kwargs,
        )
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing

    @property
    def needs_reference_model(self) -> bool:  # type: ignore[override]
        return True

    @property
    def logp_temperature(self) -> float:
        return 1.0

    def build_batch(self, group: ScoredGroup) -> tuple[dict[str, Any], dict[str, float]]:
        rewards = group.rewards
        pairs = best_worst_pairs(rewards, self.num_generations)
        batch = self.training_batch(group, [c for c, _ in pairs] + [r for _, r in pairs])
        batch["num_pairs"] = len(pairs)
        metrics = {"pairs/frac_groups": len(pairs) / max(1, group.rollout.num_groups)}
        metrics["pairs/reward_gap"] = 0.0
        if pairs:
            chosen = torch.tensor([c for c, _ in pairs], device=rewards.device)
            rejected = torch.tensor([r for _, r in pairs], device=rewards.device)
            metrics["pairs/reward_gap"] = float((rewards[chosen] - rewards[rejected]).mean())
            batch["ref_logps"] = batch["ref_logps"].sum(-1)  # sequence log-probs
        return batch, metrics

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        logps, _ = self.policy_logps(model, batch)
        k = int(batch["num_pairs"])
        if k == 0:  # placeholder row: keep the graph (DDP) but contribute nothing (weight 0)
            zero = logps.sum() * 0.0
            return zero, {f"dpo/{name}": zero.detach() for name in _DPO_METRICS}
        seq = logps.sum(-1)
        ref = batch["ref_logps"]
        losses, metrics = dpo_loss(
            seq[:k],
            seq[k:],
            ref[:k],
            ref[k:],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        return losses.mean(), {f"dpo/{name}": v.mean() for name, v in metrics.items()}

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        return float(batch["num_pairs"])


__all__ = ["OnlineDPOMethod"]
