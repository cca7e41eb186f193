"""Varlen attention for packed rows on CUDA: one kernel call per layer, whatever the samples.

A packed row holds many samples of different lengths. Run per sample (the CPU path of
:mod:`grimoire.model.packed_attention`), attention is one sdpa call per sample per layer, each a
new shape: on an H200 the packed path was 0.07x grimoire-rl with ~768 such calls a step
(docs/performance.md, "On a GPU"). A varlen kernel takes the whole row at once, ``[L, heads,
head_dim]`` with the samples' offsets ``cu_seqlens``, and attends causally within each sample.

Which kernel (:func:`choose_route`, the choice logged once per reason):

1. ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch's flash kernel; CUDA only: on
   a CPU it raises NotImplementedError), causal through ``window_size=(-1, 0)``, GQA through
   ``enable_gqa``;
2. ``flash_attn``: the flash-attn package's ``flash_attn_varlen_func`` (``causal=True``; GQA
   natively), on a torch without ``varlen_attn``;
3. ``per_sample``: causal sdpa per sample, everywhere else: a CPU, fp32 inputs (the flash kernels
   take fp16/bf16 only), attention dropout (they take none here), a GPU before sm80, a head
   dimension they do not take (over 256 or not a multiple of 8).

FlexAttention with a document mask is not a route: run eagerly it materialises the full
``L x L`` scores, the very cost packing avoids, and compiled it specialises on the row length
(a recompile per new length unless dynamic shapes hold up, which nothing here has measured).

``cu_seqlens`` and ``max_seqlen`` come from the collator's host-side lengths
(:class:`~grimoire.forward.attention_hints.RowsHint`): no host sync. Unmeasured on a GPU:
``benchmarks/gpu_checks.py varlen-parity`` checks it against the per-sample path on CUDA, and
``benchmarks/gpu_check.sh`` times it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

#: The routes, fastest first.
ROUTES = ("varlen", "flash_attn", "per_sample")


@dataclass(frozen=True)
class Kernels:
    """What this process can run: ``torch_varlen`` (``torch.nn.attention.varlen.varlen_attn``
    exists), ``flash_attn`` (the flash-attn package is installed), and the CUDA device's
    compute capability (None without CUDA)."""

    torch_varlen: bool
    flash_attn: bool
    capability: tuple[int, int] | None


@functools.cache
def available_kernels(device_index: int | None = None) -> Kernels:
    """Probe once per device: imports and the device's capability (no kernel is run)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.9)

        torch_varlen = True
    except ImportError:
        torch_varlen = False
    flash = importlib.util.find_spec("flash_attn") is not None
    capability = None
    if torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(device_index))
    return Kernels(torch_varlen, flash, capability)  # type: ignore[arg-type]


def choose_route(
    device_type: str, dtype: torch.dtype, head_dim: int, dropout: float, kernels: Kernels
) -> tuple[str, str]:
    """``(route, reason)`` for a packed row's attention: one of :data:`ROUTES`.

    ``dtype`` is what the kernel would see (the autocast dtype under autocast).
    """
    if device_type != "cuda":
        return (
            "per_sample",
            f"varlen kernels run on CUDA only; causal sdpa per sample on {device_type}",
        )
    if dropout > 0:
        return "per_sample", f"attention dropout {dropout}: the varlen kernels here take none"
    if dtype not in (torch.float16, torch.bfloat16):
        return "per_sample", f"{dtype} inputs: flash varlen kernels take fp16/bf16 only"
    if kernels.capability is not None and kernels.capability < (8, 0):
        return "per_sample", f"compute capability {kernels.capability}: flash kernels need sm80+"
    if head_dim > 256 or head_dim % 8:
        return "per_sample", f"head_dim {head_dim}: flash kernels take multiples of 8 up to 256"
    if kernels.torch_varlen:
        return "varlen", "torch.nn.attention.varlen.varlen_attn: one call per layer"
    if kernels.flash_attn:
        return "flash_attn", "flash_attn.flash_attn_varlen_func (torch has no varlen_attn)"
    return "per_sample", "no varlen kernel (torch without varlen_attn, no flash-attn installed)"


_logged: set[tuple[str, str]] = set()


def log_route(route: str, reason: str) -> None:
    """Say once per (route, reason) which kernel packed rows take, and why."""
    if (route, reason) not in _logged:
        _logged.add((route, reason))
        logger.info("packed attention: %s (%s)", route, reason)


def kernel_dtype(query: Tensor) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype under autocast (sdpa is cast by autocast;
    a custom kernel is not, and rotary embeddings leave q/k in fp32), else the query's."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def cuda_route(model_dtype: torch.dtype, head_dim: int, dropout: float) -> tuple[str, str]:
    """The route packed rows would take on this machine's CUDA device (for the packing
    decision, before any forward)."""
    return choose_route("cuda", model_dtype, head_dim, dropout, available_kernels())


def varlen_forward(
    route: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scaling: float | None,
) -> Tensor:
    """Causal attention within each segment of one packed row, in one kernel call.

    ``query``: ``[1, heads, L, head_dim]``, ``key``/``value``: ``[1, kv_heads, L, head_dim]``
    (transformers' layout); ``cu_seqlens``: ``[segments + 1]`` int32 on the device covering all
    ``L`` positions. Returns ``[1, L, heads, head_dim]`` like transformers' attention functions.
    The varlen kernels take ``[L, heads, head_dim]`` (a transposed view: no copy) and share the
    offsets between queries and keys (self-attention).
    """
    dtype = kernel_dtype(query)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
    if route == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        # window_size must be this TUPLE: varlen_attn derives is_causal from == (-1, 0).
        # Without return_aux it returns the output alone (its annotation also admits the pair).
        out = cast(
            Tensor,
            varlen_attn(
                q,
                k,
                v,
                cu_seqlens,
                cu_seqlens,
                max_seqlen,
                max_seqlen,
                scale=scaling,
                window_size=(-1, 0),
                enable_gqa=q.shape[1] != k.shape[1],
            ),
        )
    elif route == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            softmax_scale=scaling,
            causal=True,
        )
    else:
        raise ValueError(f"varlen_forward: unknown route {route!r}")
    return out.unsqueeze(0)


def route_for(query: Tensor, dropout: float) -> tuple[str, str]:
    """The route for this call's ``query`` (``[B, heads, L, head_dim]``), logged once."""
    index = query.device.index if query.device.type == "cuda" else None
    kernels = available_kernels(index) if query.device.type == "cuda" else _NO_KERNELS
    route, reason = choose_route(
        query.device.type, kernel_dtype(query), query.shape[-1], dropout, kernels
    )
    log_route(route, reason)
    return route, reason


_NO_KERNELS = Kernels(False, False, None)


def describe(kernels: Kernels | None = None) -> dict[str, Any]:
    """What was probed, for logs and the GPU check."""
    k = kernels or available_kernels()
    return {"torch_varlen": k.torch_varlen, "flash_attn": k.flash_attn, "capability": k.capability}


__all__ = [
    "ROUTES",
    "Kernels",
    "available_kernels",
    "choose_route",
    "cuda_route",
    "describe",
    "kernel_dtype",
    "log_route",
    "route_for",
    "varlen_forward",
]
