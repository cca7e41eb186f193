"""Training methods: one loss class per method, sharing :mod:`grimoire.logprobs`."""

from .base import GrimoireLoss
from .cpo import CPOLoss
from .dpo import DPOLoss
from .ipo import IPOLoss
from .kto import KTOLoss
from .orpo import ORPOLoss
from .reward import RewardModelLoss
from .sft import SFTLoss
from .simpo import SimPOLoss

__all__ = [
    "CPOLoss",
    "DPOLoss",
    "GrimoireLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "RewardModelLoss",
    "SFTLoss",
    "SimPOLoss",
]
