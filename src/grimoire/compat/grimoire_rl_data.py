"""What grimoire-rl's data modules held, by module: ``grimoire.data.sft``, ``.preference``,
``.kto``, ``.grpo`` and ``.cache`` (thin modules at those paths import their names from here).

Grimoire's own code imports each name from its stage folder (``rows/``, ``collate/``,
``forward/precomputed.py``); ``grimoire.data`` itself is Grimoire's public data API.
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

#: grimoire-rl's module -> the names it held; the modules at those paths export exactly these
#: (tests/test_grimoire_rl_api.py checks).
MODULES: dict[str, tuple[str, ...]] = {
    "grimoire.data.sft": ("PackedSFTCollator", "SFTCollator", "tokenize_sft"),
    "grimoire.data.preference": ("PreferenceCollator", "tokenize_preference"),
    "grimoire.data.kto": ("KTOCollator", "tokenize_kto"),
    "grimoire.data.grpo": ("GRPOCollator", "tokenize_grpo"),
    "grimoire.data.cache": ("cache_reference_log_probs",),
}

__all__ = [
    "MODULES",
    "GRPOCollator",
    "KTOCollator",
    "PackedSFTCollator",
    "PreferenceCollator",
    "SFTCollator",
    "cache_reference_log_probs",
    "tokenize_grpo",
    "tokenize_kto",
    "tokenize_preference",
    "tokenize_sft",
]
