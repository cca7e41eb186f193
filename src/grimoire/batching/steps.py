"""Which samples each rank trains on at each optimizer step.

A step consumes one *global batch* of ``batch_size x gradient_accumulation_steps x world_size``
samples drawn from a per-epoch permutation (seeded by ``seed + epoch``, so every pass reshuffles
and every rank computes the same permutation without communication). The plan for
``(epoch, step)`` is a pure function, which makes resuming mid-epoch exact and free: nothing is
replayed, the planner just starts at the saved step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from grimoire.batching.bin_packing import plan_global_batch


@dataclass
class StepPlanner:
    """Plans micro-batches (lists of dataset indices) for one rank.

    Without a token budget every rank runs ``grad_accum`` micro-batches of up to ``batch_size``
    rows. With ``max_tokens_per_device`` the global batch is balanced across ranks by token count
    and bin-packed into as many micro-batches as needed; every rank gets the same number.
    An empty list is a *dummy* micro-batch: the trainer runs it with loss weight 0 so collective
    ops (DDP's gradient all-reduce) stay in lock-step across ranks.
    """

    num_samples: int
    batch_size: int
    grad_accum: int = 1
    world_size: int = 1
    rank: int = 0
    seed: int = 42
    lengths: Sequence[int] | None = None
    max_tokens_per_device: int | None = None
    shuffle: bool = True
    #: Optimizer steps per global batch (>1 for online methods that take several policy updates
    #: on one rollout batch, e.g. GRPO's num_iterations): step ``s`` uses batch ``s // repeat``.
    repeat: int = 1
    #: With ``max_tokens_per_device``: micro-batches are padded ``[rows, longest]`` tensors and
    #: the budget bounds ``rows * longest`` instead of the packed row's token sum.
    padded: bool = False

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_samples / self.global_batch)) * self.repeat

    def permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def step_indices(self, epoch: int, step: int) -> np.ndarray:
        """Dataset indices of the global batch of ``step`` (0-based within ``epoch``)."""
        start = (step // self.repeat) * self.global_batch
        return self.permutation(epoch)[start : start + self.global_batch]

    def plan(self, epoch: int, step: int) -> list[list[int]]:
        """This rank's micro-batches for ``(epoch, step)``; ``[]`` marks a dummy micro-batch."""
        ids = self.step_indices(epoch, step)
        if self.max_tokens_per_device is not None:
            assert self.lengths is not None, "a token budget needs sample lengths"
            lengths = [int(self.lengths[i]) for i in ids]
            plan = plan_global_batch(
                lengths, self.world_size, self.max_tokens_per_device, padded=self.padded
            )
            return [[int(ids[j]) for j in micro] for micro in plan[self.rank]]
        # Strided split across ranks, then consecutive micro-batches; short final steps leave
        # some micro-batches smaller or empty (dummies) rather than dropping data.
        mine = [int(i) for i in ids[self.rank :: self.world_size]]
        return [
            mine[k * self.batch_size : (k + 1) * self.batch_size] for k in range(self.grad_accum)
        ]
