"""DeepSpeed-Ulysses attention (Jacobs et al., 2023) over a packed row split across processes.

Under sequence parallelism (:mod:`grimoire.forward.sequence_split`) each of the ``N`` processes
of a sequence group runs the model on ``L/N`` consecutive tokens of one packed row. Everything
but attention is per token, so it runs on the slice as is (rotary embeddings included: each rank
applies them to its own tokens at the row's own positions). Attention needs every token of the
row, so this attention function, registered with transformers as :data:`NAME`, does:

1. one all-to-all per tensor that swaps the sequence split for a head split:
   q ``[B, H, L/N, D]`` -> ``[B, H/N, L, D]`` (k, v likewise with their ``H_kv`` heads);
2. an all-gather of the row's ``position_ids`` (``[B, L]`` ints, once per forward, shared by
   every layer), whose restarts mark the samples; a sample that crosses a slice boundary keeps
   its continuous positions, and no query attends outside its own sample;
3. grimoire's packed per-sample causal attention
   (:func:`grimoire.model.packed_attention.packed_sdpa_attention_forward`) on the whole row, for
   this rank's ``H/N`` heads;
4. the inverse all-to-all: ``[B, L, H/N, D]`` -> ``[B, L/N, H, D]``, this rank's tokens again.

With no sequence group active (sampling runs unsplit on one rank of the group:
:func:`grimoire.forward.sequence_split.from_leader`) it is grimoire's packed attention, KV cache
included, exactly as a model with that attention samples.

The all-to-alls are torch's functional collectives (``all_to_all_single_autograd``), whose
backward is the inverse all-to-all: gloo (CPU) and NCCL both implement it. Communication per
layer: 4 all-to-alls of ``1/N`` of a slice's q/k/v/output each, independent of ``N`` per
process. Query head ``h`` uses key/value head ``h // (H / H_kv)``; cutting both head axes into
``N`` contiguous chunks keeps each query head with its key/value head on the same rank when
``N`` divides ``H_kv``. When it does not (grouped-query attention with fewer key/value heads
than ``N``, or 3 of them over 2 processes), each key/value head is repeated ``r = N / gcd(H_kv,
N)`` times before the exchange (:func:`repeat_kv_for`), as DeepSpeed-Ulysses does: ``H_kv * r``
heads, a multiple of ``N`` that divides ``H``, and query head ``h`` still meets its own
(``h // (H / (H_kv r)) // r = h // (H / H_kv)``); the repeat's backward sums the copies'
gradients. The cost is ``r`` times the key/value all-to-all volume. Only ``H`` must be
divisible by ``N`` (:func:`unsupported_reason`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from grimoire.errors import ConfigError
from grimoire.forward.attention_hints import ULYSSES_ATTENTION, rows_hint
from grimoire.forward.sequence_split import SequenceGroup, gather_positions, sequence_group
from grimoire.model import packed_attention
from grimoire.model.blocks import peft_base

#: The name the attention and mask functions are registered under (``config._attn_implementation``).
NAME = ULYSSES_ATTENTION


def _all_to_all(x: Tensor, sp: SequenceGroup) -> Tensor:
    """``x`` ``[N, ...]``: chunk ``j`` goes to rank ``j``; returns ``[N, ...]``, chunk ``j`` from
    rank ``j`` (autograd: the backward is the inverse all-to-all)."""
    from torch.distributed._functional_collectives import (
        AsyncCollectiveTensor,
        all_to_all_single_autograd,
    )

    out = all_to_all_single_autograd(x.contiguous(), None, None, sp.group)
    # The functional result is an async handle; waiting here keeps every later op ordinary.
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


def seq_to_heads(x: Tensor, sp: SequenceGroup) -> Tensor:
    """``[B, H, L/N, D]`` (this rank's tokens, every head) -> ``[B, H/N, L, D]`` (every token,
    this rank's heads)."""
    b, h, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [N (head chunk), B, H/N, L/N, D]
    got = _all_to_all(chunks, sp)  # [N (sequence slice), B, H/N, L/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: Tensor, sp: SequenceGroup) -> Tensor:
    """``[B, L, H/N, D]`` (attention's output layout, this rank's heads) -> ``[B, L/N, H, D]``."""
    b, length, hn, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, length // n, hn, d).transpose(0, 1)  # [N (slice), B, L/N, H/N, D]
    got = _all_to_all(chunks, sp)  # [N (head chunk), B, L/N, H/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, length // n, n * hn, d)


# Every layer of one forward (and its checkpoint recompute) gets the same local position_ids
# tensor: gather the row's once, and hand back the same tensor, so the packed attention's own
# cache of sample lengths (keyed on the tensor) is read once per forward too.
_last_positions: tuple[Any, int, Tensor] | None = None


def row_positions(local: Tensor, sp: SequenceGroup) -> Tensor:
    """The whole row's ``position_ids`` from this rank's slice, gathered once per forward."""
    global _last_positions
    cached = _last_positions
    if cached is not None and cached[0]() is local and cached[1] == local._version:
        return cached[2]
    full = gather_positions(local, sp)
    if not local.is_inference():
        _last_positions = (weakref.ref(local), local._version, full)
    return full


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Per-sample causal attention over the whole packed row, this rank's slice in and out.

    ``query``: ``[B, H, L/N, D]``, ``key``/``value``: ``[B, H_kv, L/N, D]``; returns
    ``([B, L/N, H, D], None)`` like transformers' attention functions.
    """
    sp = sequence_group()
    if sp is None:  # whole rows (sampling, with its KV cache): the plain packed attention
        return packed_attention.packed_sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    # The model's mask was built from this rank's slice alone: it can only say "causal" (None,
    # or the packed marker), never anything this function could use; a real mask is refused.
    causal = attention_mask is None or attention_mask is packed_attention.PACKED_CAUSAL
    if not causal and rows_hint(attention_mask) is None:
        raise RuntimeError(
            f"{NAME}: got an attention mask; sequence parallelism scores one packed row "
            "with position_ids and no mask (padded rows and KV caches are not split)"
        )
    local_positions = kwargs.pop("position_ids", None)
    if local_positions is None or local_positions.shape[-1] != query.shape[2]:
        raise RuntimeError(
            f"{NAME}: {type(module).__name__} did not pass this slice's position_ids to its "
            "attention function"
        )
    positions = row_positions(local_positions, sp)
    repeat = repeat_kv_for(key.shape[1], sp.size)
    if repeat > 1:  # [B, H_kv, L/N, D] -> [B, H_kv * r, L/N, D], each head r times in a row
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t, sp) for t in (query, key, value))
    out, _ = packed_attention.packed_sdpa_attention_forward(
        module,
        q,
        k,
        v,
        packed_attention.PACKED_CAUSAL,
        dropout,
        scaling,
        is_causal,
        position_ids=positions,
        **kwargs,
    )
    return heads_to_seq(out, sp), None


def repeat_kv_for(kv_heads: int, size: int) -> int:
    """How many times each of ``kv_heads`` key/value heads is repeated so that ``size`` ranks
    can split them: the least ``r`` with ``kv_heads * r`` divisible by ``size``."""
    return size // math.gcd(kv_heads, size)


def register() -> None:
    """Register the attention function, and the packed mask function, under :data:`NAME`."""
    AttentionInterface.register(NAME, ulysses_attention_forward)
    AttentionMaskInterface.register(NAME, packed_attention.packed_sdpa_mask)


def unsupported_reason(model: torch.nn.Module, size: int) -> str | None:
    """Why ``model``'s attention cannot be split over ``size`` processes (None: it can)."""
    config = peft_base(model).config
    enabled = getattr(config, "_attn_implementation", None) == NAME
    reason = None if enabled else packed_attention.unsupported_reason(model)
    if reason is not None:
        return f"its attention is not one grimoire can split: {reason}"
    heads = config.num_attention_heads
    if heads % size:
        return (
            f"Ulysses splits attention heads over the {size} processes: the model has {heads} "
            f"attention heads, which {size} does not divide (set it to a divisor of {heads})"
        )
    return None


def enable_ulysses_attention(model: torch.nn.Module, size: int) -> None:
    """Switch ``model`` (a transformers model or a peft wrapper of one) to :data:`NAME`;
    raises ``ConfigError`` naming ``training.sequence_parallel_size`` where it cannot."""
    reason = unsupported_reason(model, size)
    if reason is not None:
        raise ConfigError([f"training.sequence_parallel_size={size}: {reason}"])
    register()
    peft_base(model).set_attn_implementation(NAME)


__all__ = [
    "NAME",
    "enable_ulysses_attention",
    "heads_to_seq",
    "register",
    "repeat_kv_for",
    "row_positions",
    "seq_to_heads",
    "ulysses_attention_forward",
    "unsupported_reason",
]
