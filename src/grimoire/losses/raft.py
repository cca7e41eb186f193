"""RAFT: reward-ranked fine-tuning (best-of-N rejection sampling + SFT on the winners).

Paper: Dong et al., "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment",
arXiv 2304.06767 (Algorithm 1). Per prompt, sample ``G = N`` completions, keep the one with the
highest reward (optionally only if ``reward >= reward_threshold``) and train on the kept ones
with the SFT objective, a token mean over all kept completion tokens::

    loss = -sum_{i in winners, t} log pi(o_it) / sum_{i in winners} |o_i|

Log-probs are at temperature 1 (plain likelihood). Loss weight: the winners' token count, so the
trainer's global normalisation gives the token mean over the whole global batch (as SFT).
No reference model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.losses.online import OnlineMethod
from grimoire.losses.online_functional import best_of_n
from grimoire.losses.sampler_correction import CORRECTION_ARGS
from grimoire.rollout.rewards.calls import RewardSpec
from grimoire.rollout.stage import ScoredGroup


class RAFTMethod(OnlineMethod):
    """Best-of-N rejection sampling fine-tuning (see the module docstring).

    ``reward_threshold``: a group's best completion is trained on only if its reward reaches it
    (``None``: always keep the best). ``num_generations=1`` is allowed (self-training on samples
    that pass the threshold).
    """

    min_generations = 1
    #: No reference model, and a likelihood loss: no sampler correction either.
    hidden_args = ("beta", "ref_model", *CORRECTION_ARGS)

    def __init__(
        self,
        reward_funcs: RewardSpec | Sequence[RewardSpec],
        reward_threshold: float | None = None,
        log_entropy: bool = False,
        min_reward: float | None = None,
        **kwargs: Any,
    ):
        unknown = sorted(set(kwargs) & {"beta", "ref_model"})
        if unknown:
            raise TypeError(f"RAFTMethod has no reference model: unexpected argument(s) {unknown}")
        if min_reward is not None and reward_threshold is not None:
            raise ValueError(
                "RAFTMethod: give reward_threshold or min_reward (its alias), not both"
            )
        super().__init__(reward_funcs, log_entropy=log_entropy, **kwargs)
        # min_reward: grimoire-rl's name (a winner below it is not trained on).
        self.reward_threshold = reward_threshold if min_reward is None else min_reward

    @property
    def logp_temperature(self) -> float:
        return 1.0

    def build_batch(self, group: ScoredGroup) -> tuple[dict[str, Any], dict[str, float]]:
        rewards = group.rewards
        winners = best_of_n(rewards, self.num_generations, self.reward_threshold)
        metrics = {
            "raft/kept_frac": len(winners) / max(1, group.rollout.num_groups),
            "raft/winner_reward_mean": float(rewards[winners].mean()) if winners else 0.0,
        }
        return self.training_batch(group, winners), metrics

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        mask = batch["completion_mask"]
        logps, entropy = self.policy_logps(model, batch)
        n_tokens = mask.sum()
        loss = -logps.sum() / n_tokens.clamp(min=1)
        metrics: dict[str, Any] = {"nll": loss.detach(), "num_loss_tokens": n_tokens.float()}
        if entropy is not None:
            metrics["entropy"] = (entropy * mask).sum() / n_tokens.clamp(min=1)
        return loss, metrics

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        return float(batch["completion_mask"].sum())


__all__ = ["RAFTMethod"]
