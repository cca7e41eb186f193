"""The plain ``nn.Linear`` fast path of the LM head: logits and gradients as matmuls by hand.

A bare Linear head with no post-head transforms and no hooks needs no autograd graph: its
logits and gradients are three plain matmuls, written into the reusable workspace
(:mod:`grimoire.forward.head.workspace`). The head weight is cast to the compute dtype once per
call rather than once per chunk. Any other head (LoRA, hooks, offloading, declared transforms)
goes through the module's own forward under autograd
(:func:`grimoire.forward.head.function._chunk_gradients`).
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import Tensor

from grimoire.forward.head.workspace import _scratch


def _plain_linear(head: torch.nn.Module, transforms: list) -> TypeGuard[torch.nn.Linear]:
    """A bare ``nn.Linear`` head with no post-head transforms and no hooks: its logits and
    gradients are three plain matmuls, done here by hand into a reusable buffer (no autograd
    graph). Anything else (LoRA, hooks, offloading) goes through the module's own forward."""
    module = torch.nn.modules.module
    hooked = (
        head._forward_hooks
        or head._forward_pre_hooks
        or "forward" in vars(head)  # accelerate's offload / device hooks replace forward
        or getattr(module, "_global_forward_hooks", None)
        or getattr(module, "_global_forward_pre_hooks", None)
    )
    return type(head) is torch.nn.Linear and not transforms and not hooked


def _plain_weight(
    head: torch.nn.Module, transforms: list, autocast: tuple[bool, torch.dtype]
) -> Tensor | None:
    """For a bare Linear head (:func:`_plain_linear`), its weight in the dtype ``F.linear``
    computes in (autocast's, if on, else the weight's), cast once per call (into the
    ``"weight"`` workspace) rather than once per chunk; ``None`` for any other head (it runs as
    a module)."""
    if not _plain_linear(head, transforms):
        return None
    weight = head.weight.detach()
    enabled, dtype = autocast
    if not enabled or dtype == weight.dtype:
        return weight
    return _scratch("weight", weight.shape, dtype, weight.device).copy_(weight)


def _linear_logits(head: torch.nn.Linear, hidden: Tensor, weight: Tensor) -> Tensor:
    """``logits [N, V]`` of a plain Linear head whose weight, cast to the compute dtype, is
    ``weight [V, H]``; written into the ``"logits"`` workspace (CPU) or a fresh buffer."""
    dtype = weight.dtype
    out = _scratch("logits", (hidden.shape[0], weight.shape[0]), dtype, hidden.device)
    torch.mm(hidden.detach().to(dtype), weight.t(), out=out)
    if head.bias is not None:
        out.add_(head.bias.detach().to(dtype))
    return out


def _linear_grads(
    head: torch.nn.Linear,
    unit: Tensor,
    weight: Tensor,
    hidden: Tensor,
    need_h: bool,
    params: tuple[Tensor, ...],
    wanted: list[int],
) -> list[Tensor | None]:
    """The gradients a plain Linear head's backward would give for ``dL/dlogits = unit``:
    ``[dL/dhidden]`` (if ``need_h``) then one per ``wanted`` parameter, each in its own dtype.

    Shapes: ``unit [N, V]`` and ``weight [V, H]`` in the compute dtype, ``hidden [N, H]``.
    """
    out: list[Tensor | None] = []
    if need_h:
        out.append(torch.mm(unit, weight).to(hidden.dtype))
    for i in wanted:
        p = params[i]
        if p is head.weight:
            h = hidden.to(unit.dtype)
            if unit.dtype == p.dtype:
                out.append(torch.mm(unit.t(), h))
            else:  # bf16 compute, fp32 weight: the bf16 product in scratch, one fresh fp32 copy
                dw = _scratch("dweight", tuple(p.shape), unit.dtype, unit.device)
                out.append(torch.mm(unit.t(), h, out=dw).to(p.dtype))
        elif p is head.bias:
            out.append(unit.sum(0).to(p.dtype))
        else:  # pragma: no cover - a plain Linear has no other parameters
            out.append(None)
    return out
