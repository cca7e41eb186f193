"""Preference data under grimoire-rl's module path (``grimoire.data.preference``); a facade."""

from grimoire.collate.preference import PreferenceCollator
from grimoire.rows.preference import tokenize_preference

__all__ = ["PreferenceCollator", "tokenize_preference"]
