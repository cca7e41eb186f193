"""Tokenizers, collators and dataset sources for every method."""

from .sft import SFTCollator, tokenize_sft
from .sources import load_source, tokenize_dataset

__all__ = ["SFTCollator", "load_source", "tokenize_dataset", "tokenize_sft"]
