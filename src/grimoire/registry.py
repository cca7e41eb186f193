"""grimoire-rl's import path ``grimoire.registry``: a thin module over grimoire.compat."""

from grimoire.compat.grimoire_rl_registry import (
    CALLBACKS,
    LOSSES,
    TOKENIZERS,
    UnknownNameError,
    get_loss_class,
    get_tokenize_fn,
)

__all__ = [
    "CALLBACKS",
    "LOSSES",
    "TOKENIZERS",
    "UnknownNameError",
    "get_loss_class",
    "get_tokenize_fn",
]
