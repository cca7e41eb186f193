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

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.config.context import TrainingContext
from grimoire.losses.online import OnlineMethod
from grimoire.losses.online_functional import masked_mean, rloo_advantages
from grimoire.rollout.rewards.calls import RewardSpec
from grimoire.rollout.stage import ScoredGroup


class RLOOMethod(OnlineMethod):
    """REINFORCE Leave-One-Out (see the module docstring).

    Args (besides :class:`OnlineMethod`'s): ``beta`` (KL-penalty coefficient in the reward,
    default 0.05, TRL's RLOO default; 0 disables the reference), ``normalize_advantages``
    (divide by the micro-batch's advantage std; off by default, as the paper).
    """

    splits_sequences = True

    def __init__(
        self,
        reward_funcs: RewardSpec | Sequence[RewardSpec],
        num_generations: int = 4,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        **kwargs: Any,
    ):
        super().__init__(reward_funcs, num_generations=num_generations, beta=beta, **kwargs)
        self.normalize_advantages = normalize_advantages

    @property
    def needs_old_logps(self) -> bool:
        return self.beta > 0  # the KL penalty needs the sampling policy's log-probs

    def build_batches(
        self, ctx: TrainingContext, groups: list[ScoredGroup]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        batches, advantages, kl_sum, penalized_sum = [], [], 0.0, 0.0
        for group in groups:
            batch = self.training_batch(group, range(group.rewards.numel()))
            rewards = group.rewards.float()
            if self.beta > 0:
                kl = (batch["old_logps"] - batch.pop("ref_logps")).sum(-1)
                rewards = rewards - self.beta * kl
                kl_sum += float(kl.sum())
                penalized_sum += float(rewards.sum())
            if not self.max_staleness:  # asynchronous: the sampler's, for the IS weight
                batch.pop("old_logps", None)
            advantages.append(rloo_advantages(rewards, self.num_generations))
            batches.append(batch)
        if self.normalize_advantages:
            # Over the step's whole generation batch (every real group of every rank): the
            # result must not depend on how the step is split into micro-batches or processes.
            a = torch.cat(advantages).double() if advantages else torch.zeros(0)
            n, s1, s2 = ctx.all_reduce_sum([float(a.numel()), float(a.sum()), float((a * a).sum())])
            mean = s1 / max(n, 1.0)
            std = math.sqrt(max(0.0, (s2 - n * mean * mean) / (n - 1))) if n > 1 else 0.0
            advantages = [(adv - mean) / (std + 1e-8) for adv in advantages]
        for batch, adv in zip(batches, advantages):
            batch["advantages"] = adv.float()
        metrics = {}
        n_local = sum(float(g.rewards.numel()) for g in groups)
        if self.beta > 0 and n_local:
            metrics = {"kl": kl_sum / n_local, "rewards/penalized_mean": penalized_sum / n_local}
        return batches, metrics

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        mask = batch["completion_mask"]
        logps, entropy = self.policy_logps(model, batch)
        # One update per rollout: the sampling policy's log-probs are the current ones, detached.
        weights, is_metrics = self.importance_weights(
            batch, logps.detach(), logps, batch["advantages"]
        )
        seq_logps = logps.sum(-1)
        weighted = seq_logps if weights is None else (logps * weights).sum(-1)
        valid = (mask.sum(-1) > 0).float()
        adv = batch["advantages"].float()
        loss = -(adv * weighted * valid).sum() / valid.sum().clamp(min=1.0)
        metrics: dict[str, Any] = {
            "advantages/abs_mean": (adv.abs() * valid).sum().detach() / valid.sum().clamp(min=1),
            "logps/seq_mean": masked_mean(seq_logps, valid),
        }
        metrics.update(is_metrics)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        return loss, metrics


__all__ = ["RLOOMethod"]
