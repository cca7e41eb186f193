"""Grimoire: post-training for LLMs — one training loop, pluggable methods."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from grimoire.config.training import TrainingConfig
    from grimoire.model.gguf import resolve_pretrained
    from grimoire.parallel.launcher import LaunchError, launch
    from grimoire.rows.sources import resolve_path
    from grimoire.training.callbacks import TrainerCallback
    from grimoire.training.heldout import ExactMatchCallback, TextNLLCallback
    from grimoire.training.trainer import GrimoireTrainer

_LAZY = {
    "GrimoireTrainer": "grimoire.training.trainer",
    "TrainingConfig": "grimoire.config.training",
    "TrainerCallback": "grimoire.training.callbacks",
    "ExactMatchCallback": "grimoire.training.heldout",
    "TextNLLCallback": "grimoire.training.heldout",
    "launch": "grimoire.parallel.launcher",
    "LaunchError": "grimoire.parallel.launcher",
    "resolve_path": "grimoire.rows.sources",
    "resolve_pretrained": "grimoire.model.gguf",
}

__all__ = [
    "ExactMatchCallback",
    "GrimoireTrainer",
    "LaunchError",
    "TextNLLCallback",
    "TrainerCallback",
    "TrainingConfig",
    "__version__",
    "launch",
    "resolve_path",
    "resolve_pretrained",
]


def __getattr__(name: str) -> object:
    # Lazy so `import grimoire` stays fast (accelerate/transformers load on first use of the
    # trainer), and so the package root imports nothing at import time: every stage below may
    # import its own `grimoire.<stage>` modules without a cycle through this facade.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'grimoire' has no attribute {name!r}")
