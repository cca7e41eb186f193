"""Attention over packed rows that computes only the within-sample blocks.

A padding-free micro-batch is one ``[1, L]`` row of concatenated samples whose ``position_ids``
restart at every sample, with no attention mask (:mod:`grimoire.collate.packing`). transformers'
sdpa path turns that into a dense ``[1, 1, L, L]`` block-diagonal causal mask and the kernel
computes every one of the ``L x L`` scores; on long-tailed SFT data most of them are masked out
(4x on the benchmark of ``docs/performance.md``). This module registers ``grimoire_packed_sdpa``:

- a *mask* function (transformers' ``AttentionMaskInterface``) that, for exactly the packed case
  (``create_causal_mask`` found sample restarts in ``position_ids``, no 2D mask, no cache, no
  sliding window or extra mask functions), returns the :data:`PACKED_CAUSAL` marker instead of
  materialising the ``L x L`` mask, and otherwise returns what ``sdpa_mask`` returns;
- an *attention* function (``AttentionInterface``) that, given the marker, attends causally
  within each sample: on CUDA with fp16/bf16 inputs in ONE varlen kernel call per layer
  (:mod:`grimoire.model.varlen_attention`), elsewhere by splitting q/k/v at the sample
  boundaries and running transformers' own sdpa forward with ``is_causal=True`` on each sample;
  given anything else it IS transformers' sdpa forward, unchanged (on CUDA under a fixed set of
  sdpa kernels, below).

The sample boundaries come from the collator's host-side lengths when the forward passes them
(:mod:`grimoire.forward.attention_hints`: a 4-D marker mask that transformers passes through
without building or reading a mask, also used for right-padded rows, which then run plain causal
sdpa without a mask); otherwise they are read off ``position_ids`` once per forward (a host
sync on a GPU).

So padded batches, generation with a KV cache and evaluation take the sdpa code path as before;
only the packed training/scoring passes change, and those compute the same attention (each
query attends causally within its own sample, as the dense mask said). The marker is a plain
object, not a tensor: if it ever reached another attention function it fails loudly instead of
being read as "attend everywhere".

:func:`enable_packed_attention` selects it on a model where that is exact: a decoder whose
attention is plain causal sdpa (the architectures in :data:`SUPPORTED_MODEL_TYPES`, on their sdpa
implementation, no sliding window, no logit softcapping) and not compiled (the split reads the
sample lengths on the host). Anything else keeps its implementation and the reason is logged
once.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)

from grimoire.forward.attention_hints import PACKED_ATTENTION, RowsHint, rows_hint
from grimoire.model.blocks import peft_base
from grimoire.model.varlen_attention import route_for, varlen_forward

logger = logging.getLogger(__name__)

#: The name the attention and mask functions are registered under (``config._attn_implementation``).
NAME = PACKED_ATTENTION

#: Architectures whose attention we checked passes ``position_ids`` to the attention function and
#: is plain causal sdpa (scaled dot product, rotary applied before, no bias/softcap): their
#: decoder layers forward ``position_ids`` in the attention kwargs (transformers 5).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _PackedCausal:
    """Stands for "causal within each sample of the packed row, samples read from position_ids"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PACKED_CAUSAL"


#: What the mask function returns for a packed row instead of the dense block-diagonal mask.
PACKED_CAUSAL = _PackedCausal()


def packed_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | _PackedCausal | None:
    """``sdpa_mask``, except for a packed row, where it returns :data:`PACKED_CAUSAL`.

    ``create_causal_mask`` reaches here with ``allow_is_causal_skip=False`` and no 2D mask and
    no cache offsets only when it found sample restarts in ``position_ids`` (it disables the skip
    for packing) or when a model adds its own mask functions (then ``use_vmap`` is set) or block
    ids (no supported architecture does). Sliding windows (``local_size``) and bidirectional masks
    (``allow_is_bidirectional_skip``) keep the dense mask.
    """
    packed = (
        attention_mask is None
        and not allow_is_causal_skip
        and not allow_is_bidirectional_skip
        and not use_vmap
        and local_size is None
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == 0
        and kv_offset == 0
        and q_length == kv_length
        and q_length > 1
    )
    if packed:
        return PACKED_CAUSAL
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        **kwargs,
    )


# Every layer (and its checkpoint recompute) of one forward gets the same position_ids tensor:
# read the sample lengths off it once (a host sync on GPU) instead of once per layer.
_last_segments: tuple[Any, int, list[list[int]]] | None = None


def sample_lengths(position_ids: torch.Tensor, batch_size: int) -> list[list[int]]:
    """Per row, the lengths of its samples: a new sample starts wherever ``position_ids`` is not
    the previous position + 1 (the rule of transformers' ``find_packed_sequence_indices``)."""
    global _last_segments
    cached = _last_segments
    # Inference tensors have no version counter, so they are never cached (read every call).
    cacheable = not position_ids.is_inference()
    if (
        cacheable
        and cached is not None
        and cached[0]() is position_ids
        and cached[1] == position_ids._version
        and len(cached[2]) == batch_size
    ):
        return cached[2]
    pos = position_ids.expand(batch_size, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    lengths: list[list[int]] = []
    length = pos.shape[1]
    for row in starts.cpu().tolist():
        idx = [i for i, s in enumerate(row) if s] + [length]
        lengths.append([b - a for a, b in zip(idx[:-1], idx[1:], strict=True)])
    if cacheable:
        _last_segments = (weakref.ref(position_ids), position_ids._version, lengths)
    return lengths


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa forward, or causal attention per sample for a packed row.

    ``query``: ``[B, heads, L, head_dim]``, ``key``/``value``: ``[B, kv_heads, L, head_dim]``;
    returns ``([B, L, heads, head_dim], None)`` like ``sdpa_attention_forward``.
    """
    hint = rows_hint(attention_mask)
    if hint is None and attention_mask is not PACKED_CAUSAL:
        with sdpa_backends(query.device):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise RuntimeError(
            f"{NAME}: {type(module).__name__} asks for a sliding window or logit softcapping, "
            "which per-sample causal sdpa does not apply; use attn_implementation='sdpa'."
        )
    if hint is not None and hint.kind == "causal":  # right-padded rows: causal, no mask
        with sdpa_backends(query.device):
            return sdpa_attention_forward(
                module, query, key, value, None, dropout, scaling, True, **kwargs
            )
    if hint is not None:
        lengths = [list(hint.segments)]
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None or position_ids.shape[-1] != query.shape[2]:
            raise RuntimeError(
                f"{NAME}: a packed row reached {type(module).__name__} without position_ids of "
                "its length; this architecture does not pass them to its attention function. "
                'Load the model with attn_implementation="sdpa" instead.'
            )
        lengths = sample_lengths(position_ids, query.shape[0])  # read once per forward
    route, _ = route_for(query, dropout)
    if route != "per_sample" and query.shape[0] == 1:
        rows = hint if hint is not None else RowsHint("packed", query.device, tuple(lengths[0]))
        out = varlen_forward(route, query, key, value, rows.cu_seqlens, rows.max_seqlen, scaling)
        return out, None
    with sdpa_backends(query.device):
        return _per_sample(module, query, key, value, dropout, scaling, lengths, **kwargs)


#: Whether the sdpa calls made here on CUDA may use cuDNN's attention (see :func:`sdpa_backends`).
_CUDNN = {"allowed": False}


def allow_cudnn_attention(allowed: bool) -> None:
    """Let (or stop) the sdpa calls made here on CUDA use cuDNN's attention: for measuring it
    (``benchmarks/profile_sft.py --cudnn``); off by default."""
    _CUDNN["allowed"] = bool(allowed)


def sdpa_backends(device: torch.device) -> Any:
    """On CUDA, the sdpa kernels of every call made here, without cuDNN's (unless
    :func:`allow_cudnn_attention`): cuDNN attention, which torch may prefer on Hopper, builds an
    execution plan per new shape, and per-sample calls (and unbucketed padded batches) meet a new
    shape nearly every call; flash and memory-efficient attention build none. Chosen inside the
    attention function so the checkpoint recompute makes the same choice. Suspected, not yet
    measured, as a cause of the packed path's 6.6x slowdown on an H200 (docs/performance.md,
    "On a GPU"); elsewhere a no-op."""
    if device.type != "cuda" or _CUDNN["allowed"]:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


#: The earlier name of :func:`sdpa_backends` (benchmarks/gpu_checks.py's sdpa-shapes uses it).
_per_sample_backends = sdpa_backends


def _per_sample(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    lengths: list[list[int]],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa on each sample of each row (``lengths[b]``: row ``b``'s sample lengths),
    concatenated back: ``[B, L, heads, head_dim]``."""
    rows = []
    for b, row_lengths in enumerate(lengths):
        if len(row_lengths) == 1:  # one sample: plain causal attention over the row
            pieces = [(query[b : b + 1], key[b : b + 1], value[b : b + 1])]
        else:
            qs = query[b : b + 1].split(row_lengths, dim=2)
            ks = key[b : b + 1].split(row_lengths, dim=2)
            vs = value[b : b + 1].split(row_lengths, dim=2)
            pieces = list(zip(qs, ks, vs, strict=True))
        outs = [
            # is_causal=True: the dense mask was causal_mask_function within each sample.
            sdpa_attention_forward(module, q, k, v, None, dropout, scaling, True, **kwargs)[0]
            for q, k, v in pieces
        ]
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


def register() -> None:
    """Register the attention and mask functions under :data:`NAME` (idempotent)."""
    AttentionInterface.register(NAME, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, packed_sdpa_mask)
    # ALL_MASK_ATTENTION_FUNCTIONS shares the class-level mapping; checked so a transformers
    # change that stops sharing it fails here rather than silently dropping the mask.
    if ALL_MASK_ATTENTION_FUNCTIONS[NAME] is not packed_sdpa_mask:
        raise RuntimeError(f"{NAME}: the mask function did not register with transformers")


_logged_reasons: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.info("packed attention: keeping the model's attention (%s)", reason)


def unsupported_reason(model: torch.nn.Module, torch_compile: bool = False) -> str | None:
    """Why :data:`NAME` would not be exact or useful on ``model`` (``None``: it would)."""
    base = peft_base(model)
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "set_attn_implementation"):
        return f"{type(base).__name__} is not a transformers model"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"model_type {model_type!r} is not one whose attention was checked to be plain "
            f"causal sdpa ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    impl = config._attn_implementation
    if impl not in ("sdpa", NAME):
        return f"attn_implementation is {impl!r}, not 'sdpa'"
    if not getattr(config, "is_causal", True):
        return "the model's attention is bidirectional"
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types)
    if not layer_types:
        sliding = getattr(config, "sliding_window", None) is not None
    if sliding:
        return "it has sliding-window layers"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "it caps attention logits"
    if torch_compile:
        return "torch_compile: the per-sample split reads sample lengths on the host"
    return None


def enable_packed_attention(model: torch.nn.Module, torch_compile: bool = False) -> bool:
    """Switch ``model`` (a transformers model, or a peft wrapper of one) to :data:`NAME` where
    that is exact; otherwise leave it and log why, once per reason. Returns whether it switched.
    """
    reason = unsupported_reason(model, torch_compile)
    if reason is not None:
        _log_once(reason)
        return False
    register()
    base = peft_base(model)
    base.set_attn_implementation(NAME)
    return base.config._attn_implementation == NAME


__all__ = [
    "NAME",
    "PACKED_CAUSAL",
    "SUPPORTED_MODEL_TYPES",
    "allow_cudnn_attention",
    "enable_packed_attention",
    "packed_sdpa_attention_forward",
    "packed_sdpa_mask",
    "register",
    "sample_lengths",
    "sdpa_backends",
    "unsupported_reason",
]
