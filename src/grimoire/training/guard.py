"""The non-finite guard: a step whose loss or gradient norm is not finite is not applied.

The flags come back in the step's one read (:func:`grimoire.training.step.finish_step`): which
micro-batches' losses were not finite (a bit mask on the device, summed over ranks in the
step's all-reduce) and whether the gradient norm was (the same on every rank after DDP's or
FSDP2's reductions), so every rank decides the same and the guard adds no host sync.

A skipped step takes no optimizer or scheduler step and leaves the weights as they were; the
data moves on (``global_step`` counts it, as Megatron's and DeepSpeed's skipped iterations do).
``max_consecutive_skipped_steps`` skipped steps in a row stop the run with
:class:`TrainingDiverged` and no final model; the last checkpoint stays the one to resume.

Two engines step on their own terms: under a loss scaler (``mixed_precision: fp16``) an
overflowing gradient is the scaler's business (it skips the step and lowers its scale, as
DeepSpeed's fp16 engine does), so only a non-finite loss counts there; DeepSpeed steps its
engine inside the last backward pass, before the flags are read, so there a non-finite step is
counted and stops the run but the engine has already applied it (its fp16 loss scaler skips
overflows itself).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from grimoire.errors import GrimoireError
from grimoire.training.step import marked

logger = logging.getLogger(__name__)


class TrainingDiverged(GrimoireError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Decides, from a step's reduced totals, whether to skip it; counts skips and says so.

    Args:
        limit: consecutive skipped steps that stop the run.
        world: the number of processes (the micro-batch mask is exact on one).
        loss_scaler: whether a loss scaler owns gradient overflows (fp16 autocast).
    """

    def __init__(self, limit: int, world: int, loss_scaler: bool = False):
        self.limit, self.world, self.loss_scaler = limit, world, loss_scaler
        self.consecutive = 0
        self.last_finite: tuple[int, float] | None = None  # (step, loss)
        #: Set when the run must stop: the message of :class:`TrainingDiverged`.
        self.failure: str | None = None

    @classmethod
    def for_run(cls, config: Any, accelerator: Any) -> NonFiniteGuard:
        scaler = getattr(accelerator, "scaler", None) is not None
        return cls(config.max_consecutive_skipped_steps, accelerator.num_processes, scaler)

    def check(self, step: int, totals: dict[str, float], loss: float) -> bool:
        """True when step ``step`` (1-based) must be skipped; logs one line per skipped step."""
        bad_loss = totals.get("bad_loss", 0.0) > 0 or not math.isfinite(loss)
        bad_grad = totals.get("bad_grad", 0.0) > 0 and not self.loss_scaler
        if not (bad_loss or bad_grad):
            self.consecutive = 0
            self.last_finite = (step, loss)
            return False
        self.consecutive += 1
        what = self._what(totals, bad_loss, bad_grad)
        logger.warning(
            "step %d skipped: %s; no optimizer or scheduler step was taken (%d in a row, the run "
            "stops at %d)", step, what, self.consecutive, self.limit,
        )  # fmt: skip
        if self.consecutive >= self.limit:
            self.failure = self._failure(step, what)
        return True

    def raise_if_failed(self) -> None:
        """Raise :class:`TrainingDiverged` when the run stopped on non-finite steps."""
        if self.failure is not None:
            raise TrainingDiverged(self.failure)

    def _what(self, totals: dict[str, float], bad_loss: bool, bad_grad: bool) -> str:
        parts = []
        if bad_loss:
            mask = totals.get("bad_loss", 0.0)
            if self.world == 1 and mask > 0:
                parts.append(f"non-finite loss in micro-batch(es) {marked(mask)} of this step")
            else:
                parts.append("non-finite loss")
        if bad_grad:
            parts.append(f"gradient norm {totals.get('grad_norm', float('nan'))}")
        return ", ".join(parts)

    def _failure(self, step: int, what: str) -> str:
        if self.last_finite is None:
            last = "no step of this run had a finite loss"
        else:
            last = (
                f"the last finite loss was {self.last_finite[1]:.6g} at step {self.last_finite[0]}"
            )
        return (
            f"training diverged: {self.consecutive} consecutive steps up to step {step} had a "
            f"non-finite loss or gradient norm ({what}) and were skipped; {last}. No final model "
            "was written; the checkpoints in output_dir hold only applied steps. Try a lower "
            "learning_rate, max_grad_norm (clipping), a longer warmup, or bf16 instead of fp16; "
            "raise training.max_consecutive_skipped_steps to tolerate more."
        )


def apply_step(skip: bool, optimizer: Any, scheduler: Any, hooks: Any) -> None:
    """The optimizer and scheduler step and the hooks after it, unless the step is skipped; the
    gradients are dropped either way."""
    if not skip:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    for hook in hooks if not skip else ():
        hook.after_optimizer_step()


__all__ = ["NonFiniteGuard", "TrainingDiverged", "apply_step"]
