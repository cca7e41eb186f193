"""Reference log-prob caching under grimoire-rl's module path (``grimoire.data.cache``); a
facade."""

from grimoire.forward.precomputed import cache_reference_log_probs

__all__ = ["cache_reference_log_probs"]
