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
DeepSpeed's fp16 engine does), so only a non-finite loss counts there. A DeepSpeed engine steps
inside the step's last backward pass, before the flags are read, so there the engine decides:
its ZeRO optimizer checks the gradients for inf/NaN (all-reduced over ranks, so every rank
agrees) and skips a step that has any (no optimizer or scheduler step, the gradients dropped:
``engine.was_step_applied()`` is False), and the guard reads that verdict, a host attribute,
as the step's gradient flag. A non-finite loss whose gradients were finite (a loss term with no
path to the weights) was applied by the engine: the guard says so and counts it toward the stop.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from grimoire.errors import GrimoireError
from grimoire.parallel.deepspeed import is_engine
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
        engine: the DeepSpeed engine that steps itself (its verdict is the gradient flag).
    """

    def __init__(self, limit: int, world: int, loss_scaler: bool = False, engine: Any = None):
        self.limit, self.world, self.loss_scaler = limit, world, loss_scaler
        self.engine = engine
        self.consecutive = 0
        self.last_finite: tuple[int, float] | None = None  # (step, loss)
        #: Set when the run must stop: the message of :class:`TrainingDiverged`.
        self.failure: str | None = None

    @classmethod
    def for_run(cls, config: Any, accelerator: Any, model: Any = None) -> NonFiniteGuard:
        engine = model if is_engine(model) else None
        scaler = getattr(accelerator, "scaler", None) is not None
        scaler = scaler or (engine is not None and engine.fp16_enabled())
        limit, world = config.max_consecutive_skipped_steps, accelerator.num_processes
        return cls(limit, world, scaler, engine)

    def check(self, step: int, totals: dict[str, float], loss: float) -> bool:
        """True when step ``step`` (1-based) must be skipped, or under DeepSpeed was skipped by
        the engine; logs one line per non-finite step."""
        bad_loss = totals.get("bad_loss", 0.0) > 0 or not math.isfinite(loss)
        applied = None if self.engine is None else bool(self.engine.was_step_applied())
        if applied is None:
            bad_grad = totals.get("bad_grad", 0.0) > 0 and not self.loss_scaler
        else:  # the engine's all-reduced inf/NaN check (under fp16, its loss scaler's)
            bad_grad = not applied and not self.loss_scaler
        if not (bad_loss or bad_grad):
            self.consecutive = 0
            self.last_finite = (step, loss)
            return False
        self.consecutive += 1
        what = self._what(totals, bad_loss, bad_grad)
        if applied:
            taken = "its gradients were finite and the DeepSpeed engine applied it"
        else:
            taken = "no optimizer or scheduler step was taken"
        logger.warning(
            "step %d %s: %s; %s (%d in a row, the run stops at %d)",
            step,
            "skipped" if not applied else "not finite",
            what,
            taken,
            self.consecutive,
            self.limit,
        )
        if self.consecutive >= self.limit:
            self.failure = self._failure(step, what)
        return not applied

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
