"""The public data API: tokenizers, collators and dataset sources for every method.

A facade: each name lives in its stage folder (``grimoire.rows`` tokenizes rows,
``grimoire.collate`` turns them into tensors, ``grimoire.forward.precomputed`` caches reference
log-probs). Grimoire's own code imports from those folders; this package sits on the top layer.
Its submodules keep grimoire-rl's import paths (``grimoire.data.sft``, ``.preference``, ``.kto``,
``.grpo``, ``.cache``): thin modules over :mod:`grimoire.compat.grimoire_rl_data`.
"""

from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.collate.prompts import GRPOCollator
from grimoire.collate.sft import PackedSFTCollator, SFTCollator
from grimoire.forward.precomputed import cache_reference_log_probs
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.prompts import tokenize_grpo
from grimoire.rows.sft import tokenize_sft
from grimoire.rows.sources import load_source, tokenize_dataset

__all__ = [
    "GRPOCollator",
    "KTOCollator",
    "PackedSFTCollator",
    "PreferenceCollator",
    "SFTCollator",
    "cache_reference_log_probs",
    "load_source",
    "tokenize_dataset",
    "tokenize_grpo",
    "tokenize_kto",
    "tokenize_preference",
    "tokenize_sft",
]
