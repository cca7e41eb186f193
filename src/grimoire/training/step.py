"""The optimizer step's host reads: what the step needs on the host, and when it reads it.

On a GPU every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, a ``nonzero``, a blocking copy) waits for every kernel queued before it, and the
GPU then idles while the host catches up. The step keeps them to the ones it cannot avoid:

- loss units and token counts are counted on the host, from the collated batches, before they
  move to the device (:func:`host_units`);
- forwards and backwards (:func:`backward_micro_batches`) read nothing back (the collator's
  host-side counts travel in the batch's layout: :mod:`grimoire.forward.attention_hints`, the
  fused head's target count), and the LM head's backward checks its uniform-gradient promise
  on the device (:func:`~grimoire.forward.head.function.deferred_promise_checks`);
- :func:`finish_step` reads everything else, the metric sums, the flags, the gradient norm, the
  broken-promise flag, the non-finite flags (which micro-batches' losses, the gradient norm: the
  non-finite guard, :mod:`grimoire.training.guard`) in ONE transfer: on one process after
  clipping (the gradient scale is a host number there); with several processes the all-reduced
  loss units are needed before the gradients can be scaled, so that is one read and the
  gradient norm a second.

``tests/test_gpu_step.py`` counts the reads of an SFT and a DPO step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from grimoire.contract.method import Method
from grimoire.forward.head.function import PromiseChecks, deferred_promise_checks
from grimoire.normalise.reduction import StepReduction, WeightedMeans
from grimoire.normalise.units import backward_scale, count_tokens, gradient_scale, loss_units
from grimoire.optim.optimizers import clip_gradients, scale_gradients
from grimoire.parallel.fsdp import gradient_sync


def host_units(
    method: Method, micro: Sequence[tuple[dict[str, Any], float]]
) -> tuple[list[float], float]:
    """Each micro-batch's loss units (times its keep flag) and the step's real input tokens,
    from batches still on the host (on device batches they would be host syncs)."""
    weights = [loss_units(method, b) * keep for b, keep in micro]
    return weights, sum(count_tokens(b) * keep for b, keep in micro)


#: Micro-batches beyond this index share its bit in :func:`mark_nonfinite` (a float64 sum is
#: exact up to 2**53).
MAX_MARKED = 50


def mark_nonfinite(mask: Any, loss: torch.Tensor, index: int, weight: float) -> Any:
    """``mask`` plus bit ``index`` when micro-batch ``index``'s loss is not finite, on the device
    (no read); a micro-batch with nothing to train (``weight`` 0) is not marked."""
    if weight <= 0:
        return mask
    bad = (~torch.isfinite(loss.detach().float())).to(torch.float64).reshape(())
    return mask + bad * float(2 ** min(index, MAX_MARKED))


def marked(mask: float) -> list[int]:
    """The micro-batch indices set in a :func:`mark_nonfinite` mask read back on one process."""
    bits = int(mask) if math.isfinite(mask) else 0
    return [i for i in range(MAX_MARKED + 1) if bits >> i & 1]


def nonfinite(value: Any, measured: bool = False) -> Any:
    """1.0 where a gradient norm is not finite, as a device scalar for a tensor (read with the
    step's other numbers). A float norm is the engine's own, nan when it gives none (DeepSpeed):
    only an infinite one is flagged, unless ``measured`` says it was read from a tensor."""
    if isinstance(value, torch.Tensor):
        return (~torch.isfinite(value.detach().float())).to(torch.float64).reshape(())
    return float(not math.isfinite(value) if measured else math.isinf(value))


def backward_micro_batches(
    accelerator: Any,
    model: Any,
    method: Method,
    micro: Sequence[tuple[dict[str, Any], float]],
    weights: Sequence[float],
    norm: float,
    means: WeightedMeans,
) -> tuple[Any, PromiseChecks]:
    """Forward and back-propagate each of this rank's device micro-batches, its mean loss times
    its loss units (``weights``) / ``norm``, adding its loss and metrics to ``means``.

    Reads nothing back: returns the non-finite mask (:func:`mark_nonfinite`) and the LM head's
    deferred promise checks, both for :func:`finish_step`'s one read.
    """
    bad: Any = 0.0
    with deferred_promise_checks() as checks:
        for i, ((batch, _), weight) in enumerate(zip(micro, weights)):
            last = i == len(micro) - 1
            sync = gradient_sync(accelerator, model, last)
            # DeepSpeed steps its engine inside backward() when gradients sync: on the last.
            accelerator.gradient_state._set_sync_gradients(last)
            with sync, accelerator.autocast():
                loss, metrics = method(model, batch, training=True)
            accelerator.backward(loss * backward_scale(weight, norm))
            means.add({"loss": loss, **metrics}, weight)
            bad = mark_nonfinite(bad, loss, i, weight)
    return bad, checks


class BrokenPromiseError(RuntimeError):
    """A loss that promised ``uniform_grad`` back-propagated unequal gradients into log-probs."""


def finish_step(
    model: Any,
    accelerator: Any,
    reduction: StepReduction,
    scalars: dict[str, Any],
    means: WeightedMeans,
    *,
    norm: float,
    rescale: bool,
    max_grad_norm: float | None,
    hooks: Sequence[Any] = (),
    checks: PromiseChecks | None = None,
) -> tuple[dict[str, float], dict[str, float], float]:
    """Reduce over ranks, rescale to the mean over every loss unit (``rescale``; ``norm`` is the
    backward passes' normaliser), run the hooks, clip; ``(totals, metrics, grad_norm)``.

    Raises:
        BrokenPromiseError: when a head backward in ``checks`` saw unequal upstream gradients
            under ``uniform_grad`` (the head's weight gradient is then wrong): before the
            optimizer steps on it.
    """
    world = accelerator.num_processes
    if checks is not None and checks.broken is not None:
        scalars = {**scalars, "broken_promise": checks.broken}
    if world == 1:  # the global units are this process's, a host number: read once, at the end
        if rescale:
            scale_gradients(model, gradient_scale(norm, 1, float(scalars["units"])))
        grad_norm = _hooks_then_clip(model, accelerator, hooks, max_grad_norm)
        extra = {"grad_norm": grad_norm, "bad_grad": nonfinite(grad_norm)}
        totals, metrics = reduction.reduce({**scalars, **extra}, means)
    else:  # the all-reduced units first (read 1), then the clipped norm (read 2)
        totals, metrics = reduction.reduce(scalars, means)
        if rescale:
            scale_gradients(model, gradient_scale(norm, world, totals["units"]))
        grad_norm = _hooks_then_clip(model, accelerator, hooks, max_grad_norm)
        # Every rank holds the same norm (DDP's averaged or FSDP2's reduced gradients): every
        # rank flags the same step.
        totals["grad_norm"] = float(grad_norm)  # the one read of the norm, then a host check
        measured = isinstance(grad_norm, torch.Tensor)  # else the engine's (nan: none)
        totals["bad_grad"] = nonfinite(totals["grad_norm"], measured)
    # NaN gradients are never equal: a non-finite step is the guard's to skip, not a broken promise.
    finite = totals.get("bad_loss", 0.0) == 0 and totals.get("bad_grad", 0.0) == 0
    if totals.get("broken_promise", 0.0) > 0 and finite:
        raise BrokenPromiseError(
            "a loss computed with uniform_grad=True (a promise that its gradient is the same "
            "scalar for every token log-prob) back-propagated unequal gradients; the LM head's "
            "weight gradient of this step would be wrong, so nothing was applied. Call "
            "compute_token_logps without uniform_grad for such a loss."
        )
    return totals, metrics, totals["grad_norm"]


def _hooks_then_clip(
    model: Any, accelerator: Any, hooks: Sequence[Any], max_grad_norm: float | None
) -> Any:
    for hook in hooks:  # e.g. OSFT's gradient projection, before clipping
        hook.before_optimizer_step()
    return clip_gradients(model, accelerator, max_grad_norm)


__all__ = [
    "BrokenPromiseError",
    "backward_micro_batches",
    "finish_step",
    "host_units",
    "mark_nonfinite",
    "marked",
    "nonfinite",
]
