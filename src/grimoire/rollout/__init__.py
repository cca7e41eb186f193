"""Generation for online methods: the rollout engine interface and reward functions."""

from grimoire.rollout.engines.base import Rollout, RolloutEngine
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.rewards.scoring import (
    RewardFunctionError,
    char_match_reward,
    exact_match_reward,
    resolve_reward_funcs,
    score_completions,
)

__all__ = [
    "HFGenerateEngine",
    "RewardFunctionError",
    "Rollout",
    "RolloutEngine",
    "SamplerConfig",
    "char_match_reward",
    "exact_match_reward",
    "resolve_reward_funcs",
    "score_completions",
]
