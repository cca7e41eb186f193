"""grimoire-rl's import path ``grimoire.data.grpo``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_data import GRPOCollator, tokenize_grpo

__all__ = ["GRPOCollator", "tokenize_grpo"]
