"""grimoire-rl's import path ``grimoire.data.kto``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_data import KTOCollator, tokenize_kto

__all__ = ["KTOCollator", "tokenize_kto"]
