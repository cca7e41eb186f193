"""grimoire-rl's import path ``grimoire.data.cache``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_data import cache_reference_log_probs

__all__ = ["cache_reference_log_probs"]
