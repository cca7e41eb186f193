"""Training methods: one loss class per method, sharing :mod:`grimoire.logprobs`."""

from .base import GrimoireLoss
from .cpo import CPOLoss
from .dpo import DPOLoss
from .grpo import GRPOMethod
from .ipo import IPOLoss
from .kto import KTOLoss
from .online import OnlineMethod
from .online_dpo import OnlineDPOMethod
from .orpo import ORPOLoss
from .raft import RAFTMethod
from .reward import RewardModelLoss
from .rloo import RLOOMethod
from .sft import SFTLoss
from .simpo import SimPOLoss

__all__ = [
    "CPOLoss",
    "DPOLoss",
    "GRPOMethod",
    "GrimoireLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "OnlineDPOMethod",
    "OnlineMethod",
    "RAFTMethod",
    "RLOOMethod",
    "RewardModelLoss",
    "SFTLoss",
    "SimPOLoss",
]
