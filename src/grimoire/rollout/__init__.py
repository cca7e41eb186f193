"""Generation for online methods: the rollout engine interface and reward functions."""

from .engine import HFGenerateEngine, Rollout, RolloutEngine
from .rewards import (
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
    "char_match_reward",
    "exact_match_reward",
    "resolve_reward_funcs",
    "score_completions",
]
