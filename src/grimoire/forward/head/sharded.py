"""The fused LM head under FSDP2: the head's weight gathered around the chunk loop, never logits.

Stage: used by :func:`grimoire.forward.fused_head.fused_token_logps` when the head's parameters
are FSDP2 DTensors (``distributed="fsdp2"``; :func:`grimoire.parallel.fsdp.shard_model` leaves
the head in the root unit, with the input embedding it may be tied to).

The fused path runs the model with ``logits_to_keep=1`` and applies the head to the decoder's
hidden state itself, outside the model's forward, so FSDP's own hooks (which gather a unit's
weights around *its* forward and backward) do not cover it. This module does their job for the
unit that owns the head (:func:`head_unit`), with FSDP's public API:

* forward: :func:`gathered`: ``unit.unshard()`` (one all-gather) before the chunk loop, then
  ``unit.reshard()`` after it if FSDP had resharded it (``fsdp_reshard_after_forward``); the
  autograd Function saves the *unsharded* parameters, as ``F.linear`` would inside the forward;
* backward: :func:`unshard_in_backward` puts an identity node on the Function's outputs whose
  backward runs first and unshards the unit again (FSDP's pre-backward hook sits on the model's
  own ``[B, 1, V]`` logits, which the fused path drops). The head's gradient then lands on the
  unsharded parameter (``.grad``), where FSDP's post-backward reduce-scatters it into the
  sharded parameter (or keeps accumulating it under ``set_requires_gradient_sync(False)``),
  together with the tied embedding's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return None
    return FSDPModule


def is_dtensor(param: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return False
    return isinstance(param, DTensor)


def head_unit(
    model: torch.nn.Module, head: torch.nn.Module
) -> tuple[torch.nn.Module | None, str | None]:
    """``(unit, None)``: the FSDP2 unit that owns the head's (DTensor) parameters, the head's
    nearest ``fully_shard``-ed ancestor; ``(None, reason)`` when the fused path can't gather it.
    """
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None:  # pragma: no cover
        return None, "the LM head's weight is a DTensor and torch.distributed.fsdp is missing"
    if isinstance(head, fsdp_module):
        # Its own unit: FSDP's hooks on the head would all-gather the weight for every chunk.
        return None, (
            "the LM head is its own fully_shard unit (its hooks would all-gather the weight for "
            "every chunk); shard it together with its parent module"
        )
    names = {id(m): name for name, m in model.named_modules()}
    path = names.get(id(head))
    if path is None:
        return None, "the LM head is not a submodule of the model being run"
    modules = dict(model.named_modules())
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        owner = modules[".".join(parts[:depth])]
        if isinstance(owner, fsdp_module):
            return owner, None
    return None, (
        "the LM head's weight is a DTensor outside any fully_shard unit (tensor parallel?)"
    )


@contextlib.contextmanager
def gathered(unit: torch.nn.Module | None, head: torch.nn.Module) -> Iterator[bool]:
    """Within the block the head's parameters are full tensors (``unit.unshard()``); on exit
    the unit is resharded if it was sharded on entry. Yields whether the gather worked (every
    head parameter a plain tensor): ``False`` means the unit does not own them after all."""
    if unit is None:
        yield True
        return
    fsdp_unit = cast("FSDPModule", unit)  # the units here come from fully_shard
    was_sharded = any(is_dtensor(p) for p in head.parameters())
    fsdp_unit.unshard()
    try:
        yield not any(is_dtensor(p) for p in head.parameters())
    finally:
        if was_sharded:
            fsdp_unit.reshard()


class _UnshardInBackward(torch.autograd.Function):
    """Identity in forward; in backward, gathers ``units`` before the nodes behind it run."""

    @staticmethod
    def forward(ctx, units: tuple[torch.nn.Module, ...], *tensors: Tensor):
        ctx.units = units
        outs = tuple(t.view_as(t) for t in tensors)
        return outs[0] if len(outs) == 1 else outs

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        for unit in ctx.units:
            unit.unshard()
            # FSDP queues its end-of-backward callback (the reduce-scatter of every unit that
            # took part, ours included) from the first pre-backward hook that fires; ours may be
            # the only one (nothing but the head trainable), so queue it here too.
            state = getattr(unit, "_get_fsdp_state", lambda: None)()
            register = getattr(state, "_register_root_post_backward_final_callback", None)
            if callable(register):
                register()
        return (None, *grads)


def unshard_in_backward(
    units: tuple[torch.nn.Module, ...], outputs: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """``outputs`` unchanged, but ``units`` are gathered when backward reaches them."""
    if not units or not torch.is_grad_enabled() or not any(t.requires_grad for t in outputs):
        return outputs
    out = _UnshardInBackward.apply(units, *outputs)
    return out if isinstance(out, tuple) else (out,)


def root_unit(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost ``fully_shard``-ed module of ``model`` (``None`` if there is none)."""
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None:  # pragma: no cover
        return None
    return next((m for m in model.modules() if isinstance(m, fsdp_module)), None)


__all__ = ["gathered", "head_unit", "is_dtensor", "root_unit", "unshard_in_backward"]
