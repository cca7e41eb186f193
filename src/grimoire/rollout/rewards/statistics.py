"""Reward statistics of scored groups, shared by the rollout stage's metrics and the methods.

Layout (from :class:`grimoire.rollout.engines.base.Rollout`): ``N = num_prompts * G`` rewards,
**prompt-major** (rows ``g*G .. g*G+G-1`` are group ``g``). They live in the rollout stage, the
lower layer, so that the stage reports them without importing the methods; the methods' math
(:mod:`grimoire.losses.online_functional`) re-exports them.
"""

from __future__ import annotations

import math

from torch import Tensor


def reward_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``rewards [N]`` as float32 ``[N / G, G]`` (one row per prompt); checks the shape."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be [N] with N a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.float().view(-1, group_size)


def equal_reward_groups(rewards: Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """``[N / G]`` bool: groups whose rewards are all equal (zero advantage, no signal).

    DAPO's dynamic sampling (Yu et al., "DAPO", arXiv 2503.14476, sec. 3.2) drops them.
    """
    r = reward_groups(rewards, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) <= atol


def reward_std(values: list[float]) -> float:
    """Population std (a metric; no Bessel correction so a single value gives 0)."""
    if not values:
        return 0.0
    mu = sum(values) / len(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))


__all__ = ["equal_reward_groups", "reward_groups", "reward_std"]
