"""Per-thread CPU buffers reused by every LM-head call (policy and reference alike).

A fresh buffer of ``[rows, V]`` size comes from mmap (or from heap memory glibc has just
returned) and page-faults on first touch, every call: ~40 ms per 100 MB here, a quarter of the
logits matmul; under bf16 autocast the fresh casts alone page-faulted ~30k times a step. So on
CPU each use gets one named buffer per thread, grown and never shrunk until
:func:`release_workspace`. CUDA's caching allocator already reuses memory, so there these are
plain fresh tensors.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

#: CPU only: per-thread buffers, one per use: the ``[rows, V]`` logits of a plain-Linear head
#: (``"logits"``), the fp32 copy of a bf16 row block (``"fp32"``), the head weight cast to the
#: compute dtype and its gradient in that dtype (``"weight"``, ``"dweight"``).
_WORKSPACE = threading.local()


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised ``shape`` tensor: on CPU a view of this thread's ``name`` buffer (grown,
    never shrunk, until :func:`release_workspace`), elsewhere a fresh tensor. The caller owns
    the contents until its next call for the same ``name``."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buf = buffers.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buffers[name] = None  # free the old one before allocating the new
        buf = buffers[name] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def release_workspace() -> None:
    """Free this thread's CPU head buffers (the next head call allocates them again)."""
    _WORKSPACE.__dict__.pop("buffers", None)
