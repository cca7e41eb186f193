"""Input checks shared by the offline loss math and the loss classes built on it.

Stage: argument validation, before any loss is computed. :mod:`grimoire.losses.functional`
(pairwise methods, reward models) and :mod:`grimoire.losses.kto_functional` check their
log-prob tensors and scalar hyper-parameters here; the loss classes call the same checks in
their constructors so a bad ``beta`` fails at construction, not at the first step.
"""

from __future__ import annotations

import math

from torch import Tensor

from grimoire.errors import did_you_mean

#: What every function of the loss math returns next to its losses: detached tensors by name.
Metrics = dict[str, Tensor]


def _f32(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.float() for t in tensors)


def _check_shapes(**tensors: Tensor) -> None:
    # Strict equality, not broadcastability: a [B] vs [B, 1] mix-up would silently broadcast to a
    # [B, B] loss whose mean is a meaningless number.
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"log-prob tensors must all have the same shape [B]; got {shapes}")


def _check_beta(beta: float, name: str = "beta") -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {beta}")


def _check_weight(value: float, name: str) -> None:
    """A finite ``value >= 0`` (loss-term weights such as CPO's alpha or KTO's class weights)."""
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_label_smoothing(label_smoothing: float) -> None:
    # eps = 0.5 makes the sigmoid loss constant (zero gradient) and divides by 0 in rDPO.
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def _check_loss_type(loss_type: str, allowed: tuple[str, ...], label_smoothing: float) -> None:
    if loss_type not in allowed:
        raise ValueError(
            f"unknown loss_type {loss_type!r}{did_you_mean(loss_type, allowed)}; "
            f"expected one of {list(allowed)}"
        )
    _check_label_smoothing(label_smoothing)
    # TRL silently ignores label_smoothing where it has no meaning; a user who set it expected an
    # effect, so it is an error here.
    if label_smoothing > 0 and loss_type not in ("sigmoid", "robust"):
        raise ValueError(
            f"label_smoothing={label_smoothing} has no meaning for loss_type={loss_type!r}; "
            "it applies to 'sigmoid' (cDPO) and 'robust' (rDPO) only"
        )


def _checked_f32(beta: float, **logps: Tensor) -> tuple[Tensor, ...]:
    """Check that the ``[B]`` inputs share one shape and that ``beta`` is valid; return the
    inputs cast to float32, in the order given (the prologue of every method's math)."""
    _check_shapes(**logps)
    _check_beta(beta)
    return _f32(*logps.values())


__all__ = ["Metrics"]
