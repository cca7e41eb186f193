"""RLOO: REINFORCE with a leave-one-out baseline, KL folded into the reward.

Paper: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", arXiv 2402.14740 (sec. 3). Each completion is one action
(the whole sequence), so the gradient is REINFORCE on the sequence log-prob::

    KL_i  = sum_t (log pi_old(o_it) - log pi_ref(o_it))      (sampled log-ratio, k1)
    r'_i  = r_i - beta * KL_i                                 (KL as a reward penalty)
    A_i   = r'_i - 1/(G-1) sum_{j != i} r'_j                  (leave-one-out baseline)
    loss  = -mean_i [ A_i * sum_t log pi(o_it) ]              (A_i is a constant)

``beta=0`` loads no reference model. The KL uses the log-probs of the policy that sampled (old
log-probs, no grad), as in the paper and TRL: it is part of the reward, not a loss term.
Loss weight: one unit per sequence, so the trainer's global normalisation gives the mean over
every completion of the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..rollout.engine import Rollout, RolloutEngine
from ..rollout.rewards import RewardFn
from .online import OnlineMethod
from .online_functional import masked_mean, rloo_advantages


class RLOOMethod(OnlineMethod):
    """REINFORCE Leave-One-Out (see the module docstring).

    Args (besides :class:`OnlineMethod`'s): ``beta`` (KL-penalty coefficient in the reward,
    default 0.05, TRL's RLOO default; 0 disables the reference), ``normalize_advantages``
    (divide by the micro-batch's advantage std; off by default, as the paper).
    """

    def __init__(
        self,
        reward_funcs: RewardFn | str | Sequence[RewardFn | str],
        reward_weights: Sequence[float] | None = None,
        num_generations: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 256,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        ref_model: torch.nn.Module | None = None,
        generation_batch_size: int | None = None,
        engine: RolloutEngine | None = None,
        log_entropy: bool = True,
    ):
        super().__init__(
            reward_funcs,
            reward_weights,
            num_generations=num_generations,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            beta=beta,
            ref_model=ref_model,
            generation_batch_size=generation_batch_size,
            engine=engine,
            log_entropy=log_entropy,
        )
        self.normalize_advantages = normalize_advantages

    @property
    def needs_old_logps(self) -> bool:
        return self.beta > 0  # the KL penalty needs the sampling policy's log-probs

    def build_batch(self, rollout: Rollout, scored: dict[str, Any]) -> dict[str, Any]:
        rows = list(range(rollout.completion_ids.shape[0]))
        batch = self.rollout_batch(rollout, rows, scored)
        rewards = scored["rewards"].float()
        if self.beta > 0:
            ref = self.reference_logps(batch)
            kl = (batch["old_logps"] - ref).sum(-1)
            rewards = rewards - self.beta * kl
            batch["rollout_metrics"]["kl"] = float(kl.mean())
            batch["rollout_metrics"]["rewards/penalized_mean"] = float(rewards.mean())
        adv = rloo_advantages(rewards, self.num_generations)
        if self.normalize_advantages and adv.numel() > 1:
            adv = adv / (adv.std() + 1e-8)
        batch["advantages"] = adv
        batch.pop("old_logps", None)  # not needed by the loss
        return batch

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        mask = batch["completion_mask"]
        logps, entropy = self.policy_logps(model, batch)
        seq_logps = logps.sum(-1)
        valid = (mask.sum(-1) > 0).float()
        adv = batch["advantages"].float()
        loss = -(adv * seq_logps * valid).sum() / valid.sum().clamp(min=1.0)
        metrics: dict[str, Any] = {
            "advantages/abs_mean": (adv.abs() * valid).sum().detach() / valid.sum().clamp(min=1),
            "logps/seq_mean": masked_mean(seq_logps, valid),
        }
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        return loss, metrics


__all__ = ["RLOOMethod"]
