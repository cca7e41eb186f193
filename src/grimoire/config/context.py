"""``TrainingContext``: everything a method may read from the trainer, in one small object.

Methods (losses, the rollout stage, the reference) get this instead of the trainer, so no method
can replace a collator or write the trainer's state: what it reads is listed here, and the only
things it can do are the collectives below, which every rank must call at the same point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grimoire.config.training import TrainingConfig


def _identity(module: torch.nn.Module) -> torch.nn.Module:
    return module


@dataclass
class StepInfo:
    """Where the loop is (read-only for methods): the optimizer step about to run."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


@dataclass
class TrainingContext:
    """What a method sees of the run.

    Attributes:
        config: the run's :class:`TrainingConfig` (never rewritten).
        accelerator: the ``accelerate.Accelerator`` (device, autocast, process index/count).
        tokenizer: the tokenizer given to the trainer.
        unwrapped_model: the policy without DDP/FSDP wrappers (for binding a sampler, reading
            its dtype, disabling adapters); forwards with gradient go through the model the loss
            is called with.
        train_dataset, eval_dataset: the tokenized datasets.
        step: :class:`StepInfo` of the step being prepared (updated by the trainer).
    """

    config: TrainingConfig
    accelerator: Any
    tokenizer: Any
    unwrapped_model: torch.nn.Module
    train_dataset: Any
    eval_dataset: Any = None
    step: StepInfo = field(default_factory=StepInfo)
    #: Applied to a frozen model a method keeps beside the policy (a reference): shards it the
    #: way the policy is sharded (FSDP2), or leaves it as it is.
    prepare_frozen: Callable[[torch.nn.Module], torch.nn.Module] = _identity
    #: Whether the run's micro-batches are packed rows (the trainer's packing decision).
    packed: bool = False
    #: The process group the sums below run over: None, every process; under sequence
    #: parallelism the data dimension, since a sequence group's ranks hold the same rows and
    #: groups, and a sum over them all would count each one once per rank of the group.
    sum_group: Any = None

    @property
    def sharded(self) -> bool:
        """Whether the policy is sharded (FSDP2): then every forward is a collective."""
        return self.config.distributed == "fsdp2"

    @property
    def num_processes(self) -> int:
        """How many ranks train together (1: the collectives below are identities)."""
        return 1 if self.accelerator is None else int(self.accelerator.num_processes)

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over ranks (e.g. a count of forward passes to pad up to)."""
        return all_reduce_max(self.accelerator, value)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum floats over ranks in one collective (identity on one process); every rank must
        call it at the same point of the step."""
        return all_reduce_sum(self.accelerator, values, self.sum_group)

    def all_reduce_sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place, on its device (no host sync), and return it;
        identity on one process. Every rank must call it at the same point of the step (e.g.
        KTO's KL estimate: the ranks' ``(sum, count)`` of mismatched pairs)."""
        return all_reduce_sum_tensor(self.accelerator, tensor, self.sum_group)


def all_reduce_max(accelerator: Any, value: int) -> int:
    """The largest ``value`` over ranks (identity on one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=accelerator.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum_tensor(
    accelerator: Any, tensor: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """``tensor`` summed over ranks in place (identity on one process); ``group``: over that
    process group only (None: every rank)."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_sum(accelerator: Any, values: list[float], group: Any = None) -> list[float]:
    """The one host-side all-reduce helper: float64 sums of ``values`` over all ranks (or over
    the process group ``group``)."""
    if accelerator is None or accelerator.num_processes == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=accelerator.device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t.tolist()
    return accelerator.reduce(t, reduction="sum").tolist()


__all__ = [
    "StepInfo",
    "TrainingContext",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_sum_tensor",
]
