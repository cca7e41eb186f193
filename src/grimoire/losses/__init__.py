"""Training methods, and everything a new one is written with: the one module a custom method
imports from (docs/custom-loss.md).

- the built-in methods, one loss class each, sharing :mod:`grimoire.forward.logprobs`;
- the contract: :class:`MethodCore` (``__call__``, ``create_collator``, ``loss_weight``: what
  every method defines) and :class:`Method` (it, and the opt-in capabilities), with
  :class:`GrimoireLoss`, the base class that gives every capability its default;
- what a method's members are written with: the collators (:class:`SFTCollator`,
  :class:`PackedCollator`), the batch's layout (:func:`attention_inputs`, and the loss units
  :func:`num_targets` and :func:`num_rows`), the shared log-probs (:func:`compute_token_logps`),
  a frozen reference (:class:`Reference`) and the method's view of the run
  (:class:`TrainingContext`).
"""

from grimoire.collate.packing import PackedCollator
from grimoire.collate.sft import SFTCollator
from grimoire.config.context import TrainingContext
from grimoire.contract.layout import attention_inputs, num_rows, num_targets
from grimoire.contract.method import Method, MethodCore
from grimoire.forward.logprobs import compute_token_logps
from grimoire.forward.reference import Reference
from grimoire.losses.adapter import as_method
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
    "Method",
    "MethodCore",
    "ORPOLoss",
    "OnlineDPOMethod",
    "OnlineMethod",
    "PackedCollator",
    "RAFTMethod",
    "RLOOMethod",
    "Reference",
    "RewardModelLoss",
    "SFTCollator",
    "SFTLoss",
    "SimPOLoss",
    "TrainingContext",
    "as_method",
    "attention_inputs",
    "compute_token_logps",
    "num_rows",
    "num_targets",
]
