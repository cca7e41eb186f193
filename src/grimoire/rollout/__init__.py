"""Generation for online methods: the rollout engine interface and reward functions."""

from grimoire.rollout.engine import Rollout, RolloutEngine
from grimoire.rollout.hf import HFGenerateEngine
from grimoire.rollout.rewards import (
    RewardFunctionError,
    char_match_reward,
    exact_match_reward,
    resolve_reward_funcs,
    score_completions,
)
from grimoire.rollout.sampler import SamplerConfig

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
