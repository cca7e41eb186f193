"""Training methods: one loss class per method, sharing :mod:`grimoire.logprobs`."""

from .base import GrimoireLoss
from .sft import SFTLoss

__all__ = ["GrimoireLoss", "SFTLoss"]
