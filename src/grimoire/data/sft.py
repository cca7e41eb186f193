"""grimoire-rl's import path ``grimoire.data.sft``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_data import PackedSFTCollator, SFTCollator, tokenize_sft

__all__ = ["PackedSFTCollator", "SFTCollator", "tokenize_sft"]
