"""Tokenizers and collators for every method."""

from .sft import SFTCollator, tokenize_sft

__all__ = ["SFTCollator", "tokenize_sft"]
