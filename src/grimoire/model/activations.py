"""Bytes autograd keeps per token: the activations of a decoder layer, and the LM head's logits.

The one activation-memory model: ``grimoire estimate-memory`` (``tools/memory/estimate.py``) and
the host-memory checkpointing decision (``model/host_memory.py``) both count activations with
:func:`activation_bytes_per_token`, so they cannot disagree.

Counted tensor by tensor from what each op of a transformers Llama layer saves for backward
(read with ``torch.autograd.graph.saved_tensors_hooks`` on the real modules: the unit tests
compare these formulas with that count in fp32, under bf16 autocast and in pure bf16, full and
LoRA). With ``H`` the hidden size, ``Q = heads x head_dim``, ``K = kv_heads x head_dim``, ``I``
the MLP width, ``a`` the compute dtype's bytes and ``r`` the residual stream's:

* each RMSNorm keeps its input in fp32 (4 bytes, an upcast copy when the stream is bf16) and the
  reciprocal RMS; the normalised input too when its weight trains (``r`` bytes, ``x * rsqrt``);
  its output once for every consumer that saves it: a trained projection (under autocast each
  casts its own bf16 copy), or a LoRA branch (dropout keeps a copy and a 1-byte mask);
* attention keeps ``q``, ``k``, ``v`` after RoPE and its output (``a (2Q + 2K)``) and a log-sum-exp
  per head (fp32); grouped-query heads run natively (packed rows, no mask), so ``k``/``v`` are
  never expanded; RoPE saves only ``cos``/``sin`` (shared by all layers);
* the MLP keeps ``gate``, ``silu(gate)`` and ``up`` (``3 a I``), and the product when ``down_proj``
  trains or a LoRA branch reads it.

Frozen projections (LoRA's base) save no input: a frozen weight needs no gradient, and the
gradient of its input needs only the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from grimoire.config.model_shape import INPUT_OF, LINEARS, LoraShape, ModelShape

#: Bytes of the int64 token ids a forward keeps (the embedding's backward reads them).
ID_BYTES = 8
#: Elements of an fp32 row block in the fused head's softmax (forward/head/softmax.py).
FP32_BLOCK_ELEMS = 1 << 25


@dataclass(frozen=True)
class Numerics:
    """Bytes per element: stored weights, the residual stream, matmul outputs; autocast on?"""

    weight: int
    residual: int
    compute: int
    autocast: bool
    #: Bytes per element of a dropout mask: CUDA's fused dropout keeps a bool mask; the CPU
    #: kernel keeps its scaled noise in the input's dtype (peft's fp32 adapter input).
    mask: int = 1

    @classmethod
    def of(cls, weight: int, mixed: bool, sharded: bool, device: str = "cuda") -> Numerics:
        """``weight`` bytes of the loaded weights; ``mixed``: bf16/fp16 mixed precision;
        ``sharded``: FSDP2, whose policy gathers bf16 weights instead of autocasting."""
        mask = 1 if device == "cuda" else 4
        if weight == 4 and mixed and not sharded:
            return cls(4, 4, 2, True, mask)  # fp32 stream and norms, bf16 matmuls
        if weight == 4 and not mixed:
            return cls(4, 4, 4, False, mask)
        return cls(weight, 2, 2, False, mask)  # bf16 weights, or FSDP2 gathering bf16 copies


def layer_bytes_per_token(
    shape: ModelShape, num: Numerics, lora: LoraShape | None = None, adapter: int = 4
) -> float:
    """Bytes one decoder layer keeps for backward per token (no checkpointing). ``lora``: the
    base is frozen and only these adapters (``adapter`` bytes per element) train."""
    h, q, k, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_width, shape.intermediate
    a, r = num.compute, num.residual
    widths = {"attn_norm": h, "mlp_norm": h, "attention": q, "product": i}
    # Inputs kept as they are (one copy, however many consumers keep them), and the bytes of
    # copies a consumer makes for itself.
    kept = {"attention"}  # sdpa keeps its own output, which o_proj reads
    extra = 0.0
    for name in LINEARS:
        src = INPUT_OF[name]
        width = widths[src]
        if lora is None:  # every projection trains and keeps its input
            if num.autocast and src in ("attn_norm", "mlp_norm"):
                extra += 2 * width  # each cast of the fp32 norm output is its own bf16 copy
            else:
                kept.add(src)
            continue
        if name not in lora.targets:
            continue
        mask = num.mask * width if lora.dropout > 0 else 0  # dropout's mask
        if num.autocast:  # A's input is cast to bf16 by autocast (after any dropout)
            extra += 2 * width + mask + 2 * lora.r  # (+ A's output, kept by B)
            continue
        extra += adapter * lora.r
        if adapter == a and lora.dropout == 0:
            kept.add(src)  # A reads the very tensor
        else:  # peft's cast to the adapter's dtype, or dropout's output, is A's own copy
            extra += adapter * width + mask
    total = extra
    for src in ("attn_norm", "mlp_norm"):
        total += 4 * h + 4  # the fp32 input (or its upcast copy) and 1/rms
        total += (4 if r == 4 else 2) * h if lora is None else 0  # x * rsqrt, for dweight
        total += a * h if src in kept else 0
    total += a * (2 * q + 2 * k) + 4 * shape.heads  # q, k, v, output; log-sum-exp per head
    total += 3 * a * i  # gate, silu(gate), up
    total += a * i if "product" in kept else 0
    return total


def model_bytes_per_token(
    shape: ModelShape, num: Numerics, head_trains: bool, lora: LoraShape | None = None
) -> float:
    """Bytes per token outside the layers: token ids, RoPE's ``cos``/``sin``, the final norm,
    and its output when the LM head trains (the model's own head call keeps a view of it).

    With a frozen embedding (LoRA) nothing before the first adapter needs a gradient: the ids
    and the first norm's input are not kept, nor the masks of first-layer dropouts on it."""
    h = shape.hidden
    total = ID_BYTES + 2 * shape.head_dim * num.residual + 4 * h + 4
    total += (4 if num.residual == 4 else 2) * h if lora is None else 0
    if head_trains and not num.autocast:
        total += num.compute * h
    if lora is not None and "embed_tokens" not in lora.modules_to_save:
        total -= ID_BYTES + 4 * h + 4
        first = [t for t in lora.targets if INPUT_OF[t] == "attn_norm"]
        total -= num.mask * h * len(first) if lora.dropout > 0 else 0
    return total


def checkpointed_layer_bytes_per_token(shape: ModelShape, num: Numerics) -> float:
    """What a checkpointed layer keeps: its input hidden state (transformers' non-reentrant
    checkpoint of each decoder layer; ``cos``/``sin`` are shared)."""
    return num.residual * shape.hidden


def activation_bytes_per_token(
    shape: ModelShape,
    num: Numerics,
    *,
    checkpointing: bool,
    head_trains: bool = True,
    lora: LoraShape | None = None,
) -> float:
    """Bytes per token of a micro-batch's activations at the start of backward, the whole
    decoder: every layer kept (or, with ``checkpointing``, each layer's input plus the one layer
    backward recomputes at a time), what lies outside the layers, and backward's gradient of the
    hidden states (the one flowing and the one being formed)."""
    per_layer = layer_bytes_per_token(shape, num, lora)
    outside = model_bytes_per_token(shape, num, head_trains, lora)
    if checkpointing:
        kept = shape.layers * checkpointed_layer_bytes_per_token(shape, num) + per_layer
    else:
        kept = shape.layers * per_layer
    return kept + outside + gradient_flow_bytes_per_token(shape, num)


def gradient_flow_bytes_per_token(shape: ModelShape, num: Numerics) -> float:
    """Backward's gradient of the hidden states: the one flowing and the one being formed."""
    return 2 * num.residual * shape.hidden


# --------------------------------------------------------------------------- the LM head


@dataclass(frozen=True)
class HeadBytes:
    """Peak bytes of the LM head's log-prob computation: forward and backward, and the part of
    them that is reusable buffers (on CPU the fused head keeps them per thread between calls,
    ``forward/head/workspace.py``; CUDA allocates them afresh)."""

    forward: float
    backward: float
    path: str
    workspace: float = 0.0


def head_bytes(
    shape: ModelShape,
    num: Numerics,
    tokens: int,
    *,
    fused: bool,
    chunk_rows: int,
    head_trains: bool,
) -> HeadBytes:
    """The logits' memory for ``tokens`` positions (every position assumed to have a target).

    Fused (``forward/fused_head.py``): one ``[C, V]`` chunk of logits in the compute dtype, an
    fp32 row block of at most :data:`FP32_BLOCK_ELEMS` when that is not fp32, the head weight
    cast once per call under autocast, the gathered ``[N, H]`` head inputs and, in backward, the
    gradient of those inputs, a cast-dtype gradient buffer for the weight, and a second
    ``V x H`` gradient while a later chunk's is summed into the first.

    Full logits (``fused=False``): the model's ``[T, V]`` logits and their fp32
    copy kept by ``logsumexp``; in backward three fp32 ``[T, V]`` tensors at once (``logsumexp``'s
    ``exp(z - lse)`` and its product with the incoming gradient next to the kept logits, then the
    two gradients of the logits and their sum), and the cast back for bf16 logits.
    """
    v, h, a = shape.vocab, shape.hidden, num.compute
    if not fused:
        fp32 = 4 * tokens * v
        forward = a * tokens * v + (fp32 if a != 4 else 0)
        backward = 3 * fp32 + (a * tokens * v if a != 4 else 0)
        return HeadBytes(forward, backward, "full logits")
    rows = min(chunk_rows, tokens)
    logits = a * rows * v
    if a != 4:
        logits += 4 * v * min(rows, max(1, FP32_BLOCK_ELEMS // v))
    inputs = a * tokens * h
    weight_cast = a * v * h if num.autocast else 0
    forward = logits + inputs + weight_cast
    backward = forward + a * tokens * h  # d/d(inputs)
    dweight = a * v * h if head_trains and a != num.weight else 0  # the cast-dtype dW buffer
    backward += dweight
    if head_trains and tokens > chunk_rows:
        backward += num.weight * v * h  # a later chunk's dW, before it is summed into the first
    workspace = logits + weight_cast + dweight
    return HeadBytes(forward, backward, f"fused, {rows}-row chunks", workspace)


__all__ = [
    "HeadBytes",
    "Numerics",
    "activation_bytes_per_token",
    "checkpointed_layer_bytes_per_token",
    "gradient_flow_bytes_per_token",
    "head_bytes",
    "layer_bytes_per_token",
    "model_bytes_per_token",
]
