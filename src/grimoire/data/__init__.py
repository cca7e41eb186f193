"""Tokenizers, collators and dataset sources for every method."""

from .cache import cache_reference_log_probs
from .grpo import GRPOCollator, tokenize_grpo
from .kto import KTOCollator, tokenize_kto
from .preference import PreferenceCollator, tokenize_preference
from .sft import SFTCollator, tokenize_sft
from .sources import load_source, tokenize_dataset

__all__ = [
    "GRPOCollator",
    "KTOCollator",
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
