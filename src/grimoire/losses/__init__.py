"""Training methods: one loss class per method, sharing :mod:`grimoire.forward.logprobs`."""

from grimoire.losses.base import GrimoireLoss
from grimoire.losses.cpo import CPOLoss
from grimoire.losses.distill import DistillMethod
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.ipo import IPOLoss
from grimoire.losses.kto import KTOLoss
from grimoire.losses.online import OnlineMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.orpo import ORPOLoss
from grimoire.losses.raft import RAFTMethod
from grimoire.losses.reward import RewardModelLoss
from grimoire.losses.rloo import RLOOMethod
from grimoire.losses.sft import SFTLoss
from grimoire.losses.simpo import SimPOLoss

__all__ = [
    "CPOLoss",
    "DPOLoss",
    "DistillMethod",
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
