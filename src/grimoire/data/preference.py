"""grimoire-rl's import path ``grimoire.data.preference``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_data import PreferenceCollator, tokenize_preference

__all__ = ["PreferenceCollator", "tokenize_preference"]
