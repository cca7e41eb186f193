"""The LM head's autograd Function: per-row log-probs of ``[rows, V]`` logits, chunk by chunk.

Stage: the second half of the forward stage's fused path. :func:`grimoire.forward.fused_head.
fused_token_logps` gathers the rows that have a target and calls :class:`_HeadLogps` on them;
this module holds the softmax math (statistics and closed-form gradients, fp32, in place, in
row blocks) and the two routes to the head's gradients (recompute in backward, or eager in the
forward for a token-mean loss). See ``docs/fused-logprobs.md``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def _head_logits(head: torch.nn.Module, transforms: list, hidden: Tensor) -> Tensor:
    """``transforms(head(hidden))`` in the head's output dtype: ``[N, H] -> [N, V]``."""
    logits = head(hidden)
    for fn, value in transforms:
        logits = fn(logits, value)
    return logits


#: fp32 work on ``[rows, V]`` logits is done this many elements at a time (128 MiB temporaries),
#: so a chunk's fp32 copies never add up to ``chunk_size x V x 4`` bytes, while the head matmul
#: still runs on the whole chunk (big matmuls are what's efficient).
_FP32_BLOCK_ELEMS = 1 << 25


def _row_blocks(rows: int, vocab: int) -> list[slice]:
    step = max(1, _FP32_BLOCK_ELEMS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _fp32_scratch(like: Tensor) -> Tensor:
    """An uninitialised fp32 tensor shaped like ``like`` (the per-thread ``"fp32"`` workspace on
    CPU, a fresh tensor elsewhere)."""
    return _scratch("fp32", like.shape, torch.float32, like.device)


def _as_fp32(block: Tensor) -> Tensor:
    """``block`` itself when fp32 (callers may overwrite it), else an fp32 copy in scratch."""
    if block.dtype == torch.float32:
        return block
    return _fp32_scratch(block).copy_(block)


@torch.no_grad()
def _softmax_stats(
    logits: Tensor, targets: Tensor, want_entropy: bool, unit_grad: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Target log-probs, log-sum-exp and (optionally) entropy of each row, all fp32 ``[N]``;
    with ``unit_grad``, also ``dlogp_t/dz = onehot(t) - p`` written into it.

    Shapes: ``logits [N, V]`` (any float dtype; fp32 logits are overwritten), ``targets [N]``,
    ``unit_grad [N, V]`` in ``logits``' dtype (may be ``logits`` itself). ``unit_grad`` is the
    gradient for an upstream grad of 1 on every log-prob: the eager head scales it by the true
    upstream grad in backward. One exp pass serves the statistics and the gradient; the
    log-sum-exp is written out (``m + log(sum(exp(z - m)))``) so the fp32 block is reused.
    """
    n = logits.shape[0]
    logps = logits.new_empty(n, dtype=torch.float32)
    lse = torch.empty_like(logps)
    entropy = torch.empty_like(logps) if want_entropy else None
    fp32_out = unit_grad is not None and unit_grad.dtype == torch.float32
    for rows in _row_blocks(n, logits.shape[-1]):
        z = _as_fp32(logits[rows])
        m = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)  # all -inf row: no NaN
        t = targets[rows].unsqueeze(-1)
        picked = z.gather(-1, t).squeeze(-1)
        # exp(z - m): into ``unit_grad`` for fp32, else over the fp32 block (ours to overwrite).
        e = unit_grad[rows] if fp32_out else z
        torch.sub(z, m, out=e)  # z - m (e may alias z: elementwise, so that is safe)
        shifted = e.clone() if entropy is not None else None
        total = e.exp_().sum(-1, keepdim=True)
        log_total = total.log()
        lse[rows] = (m + log_total).squeeze(-1)
        logps[rows] = picked - lse[rows]
        if entropy is not None:
            # H = lse - sum_v p_v z_v = log(total) - sum_v e_v (z_v - m) / total.
            entropy[rows] = (log_total - (e * shifted).sum(-1, keepdim=True) / total).squeeze(-1)
        if unit_grad is None:
            continue
        e.mul_(total.reciprocal_().neg_())  # -p
        e.scatter_add_(-1, t, torch.ones_like(t, dtype=e.dtype))  # + onehot(target)
        if not fp32_out:
            unit_grad[rows] = e
    return logps, lse, entropy


@torch.no_grad()
def _grad_logits(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logps: Tensor,
    grad_entropy: Tensor | None,
    out: Tensor,
) -> Tensor:
    """``dL/dlogits`` in ``logits``' dtype from the incoming grads of logps / entropy.

    Shapes: ``logits [N, V]`` (read only unless ``out [N, V]`` is ``logits``, then overwritten),
    the rest ``[N]``. With ``p = softmax(z)``:
    ``dlogp_t/dz = onehot(t) - p`` and ``dH/dz = -p * (log p + H)``; computed in fp32, in place,
    one row block at a time.
    """
    use_entropy = entropy is not None and grad_entropy is not None
    in_place = out.dtype == torch.float32
    for rows in _row_blocks(logits.shape[0], logits.shape[-1]):
        # log p, written by one op into fresh memory, never an alias of ``logits`` (the head's
        # backward may need it); for an fp32 head straight into ``out``, which skips a copy
        # pass and a temporary per block (the fp32 promotion and subtraction are the same ops
        # as casting first, so the values are bitwise unchanged).
        z = out[rows] if in_place else _fp32_scratch(logits[rows])
        torch.sub(logits[rows], lse[rows].unsqueeze(-1), out=z)  # log p
        g = grad_logps[rows].unsqueeze(-1)
        if use_entropy:
            probs = z.exp()
            # -p * (g + e * (log p + H)), in place on log p.
            z.add_(entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].unsqueeze(-1)).add_(g)
            z.mul_(probs).neg_()
            del probs
        else:
            z.exp_().mul_(-g)  # -g * p
        z.scatter_add_(-1, targets[rows].unsqueeze(-1), g)  # + g * onehot(target)
        if not in_place:
            out[rows] = z
    return out


@dataclass
class _HeadSpec:
    """The non-tensor inputs of :class:`_HeadLogps` (one per compute_token_logps call)."""

    head: torch.nn.Module
    transforms: list
    return_entropy: bool
    device_type: str
    n_params: int  # how many trailing inputs of ``apply`` are head parameters
    chunk_size: int = 1024
    uniform_grad: bool = False  # the caller promises one upstream grad for every log-prob


def _needs_rng_replay(head: torch.nn.Module) -> bool:
    """Does the head draw random numbers (e.g. LoRA dropout on lm_head in training mode)?"""
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
        for m in head.modules()
    )


def _plain_linear(spec: _HeadSpec) -> bool:
    """A bare ``nn.Linear`` head with no post-head transforms and no hooks: its logits and
    gradients are three plain matmuls, done here by hand into a reusable buffer (no autograd
    graph). Anything else (LoRA, hooks, offloading) goes through the module's own forward."""
    head = spec.head
    module = torch.nn.modules.module
    hooked = (
        head._forward_hooks
        or head._forward_pre_hooks
        or "forward" in vars(head)  # accelerate's offload / device hooks replace forward
        or getattr(module, "_global_forward_hooks", None)
        or getattr(module, "_global_forward_pre_hooks", None)
    )
    return type(head) is torch.nn.Linear and not spec.transforms and not hooked


#: CPU only: per-thread buffers, one per use, reused by every head call (policy and reference
#: alike): the ``[rows, V]`` logits of a plain-Linear head (``"logits"``), the fp32 copy of a
#: bf16 row block (``"fp32"``), the head weight cast to the compute dtype and its gradient in that
#: dtype (``"weight"``, ``"dweight"``). A fresh buffer of that size comes from mmap (or from heap
#: memory glibc has just returned) and page-faults on first touch, every call: ~40 ms per 100 MB
#: here, a quarter of the logits matmul; under bf16 autocast the fresh casts alone page-faulted
#: ~30k times a step. Released by :func:`release_workspace`; CUDA's caching allocator already
#: reuses memory, so there these are plain fresh tensors.
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


def _plain_weight(spec: _HeadSpec, autocast: tuple[bool, torch.dtype]) -> Tensor | None:
    """For a bare Linear head (:func:`_plain_linear`), its weight in the dtype ``F.linear``
    computes in (autocast's, if on, else the weight's), cast once per call (into the
    ``"weight"`` workspace) rather than once per chunk; ``None`` for any other head (it runs as
    a module)."""
    if not _plain_linear(spec):
        return None
    weight = spec.head.weight.detach()
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


class _HeadLogps(torch.autograd.Function):
    """``log p(target)`` (and entropy) of every row, ``chunk_size`` rows of ``[C, V]`` logits at
    a time, none of them kept for backward.

    Forward: ``hidden [N, H]``, ``targets [N]`` -> ``logps [N]`` (+ ``entropy [N]``), both fp32.
    Gradients (``z``: logits, ``p = softmax(z)``, ``H`` entropy, ``g``/``e`` the incoming grads
    of logps/entropy): ``dlogp_t/dz = onehot(t) - p``; ``dH/dz = -p * (log p + H)``.

    Two ways to the gradients, exact both:

    * **recompute** (default): only ``hidden``, ``targets`` and the per-row log-sum-exp are
      saved; backward recomputes each chunk's logits (in the forward's autocast and RNG state),
      forms ``dL/dlogits`` in closed form, in place, in fp32, and backpropagates it through the
      head (by hand for a bare Linear, :func:`_plain_linear`; else with ``torch.autograd.grad``,
      so any head works: LoRA-wrapped Linear, declared transforms, dropout); parameter
      gradients are returned as the Function's, so they flow through the normal autograd graph.
      Activation checkpointing specialised to a softmax head: one extra head matmul.
    * **eager** (``spec.uniform_grad``: the caller's loss is ``c * sum(logps)``, e.g. token-mean
      NLL): the forward already backpropagates ``onehot - p`` (upstream grad 1) through the head
      and keeps the results (``[N, H]`` for ``hidden``, one parameter-sized buffer per trainable
      head parameter, summed over chunks); backward multiplies them by the one upstream grad.
      Three head matmuls instead of four and no second pass over the logits, the trick of
      Liger's fused linear cross-entropy. Backward checks the promise (every incoming grad
      equal, no grad on the entropy) and otherwise takes the recompute route, so a broken
      promise costs time, never exactness.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, targets: Tensor, spec: _HeadSpec, *params: Tensor):
        dev = spec.device_type
        ctx.spec = spec
        # Unused outputs (typically a logged-only entropy) come back as None: skip their math.
        ctx.set_materialize_grads(False)
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.rng = None
        if _needs_rng_replay(spec.head):
            ctx.rng = (torch.get_rng_state(), _device_rng_state(hidden.device))
        n = hidden.shape[0]
        need_h = ctx.needs_input_grad[0]
        wanted = [i for i in range(len(params)) if ctx.needs_input_grad[3 + i]]
        eager = spec.uniform_grad and (need_h or bool(wanted))
        logps = hidden.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if spec.return_entropy else None
        grad_h = torch.empty_like(hidden) if eager and need_h else None
        grad_params: list[Tensor | None] = [None] * len(params)
        weight = _plain_weight(spec, ctx.autocast)
        for start in range(0, n, spec.chunk_size):
            c = slice(start, min(start + spec.chunk_size, n))
            if eager:
                stats: list = []  # the statistics come out of the gradient's own pass

                def unit_grad(logits: Tensor, out: Tensor, c: slice = c, stats=stats) -> Tensor:
                    stats.append(_softmax_stats(logits, targets[c], spec.return_entropy, out))
                    return out

                _chunk_gradients(
                    spec, weight, ctx.autocast, hidden, c, unit_grad, need_h, params, wanted,
                    grad_h, grad_params,
                )  # fmt: skip
                out = stats[0]
            else:
                if weight is not None:
                    logits = _linear_logits(spec.head, hidden[c], weight)
                else:
                    logits = _head_logits(spec.head, spec.transforms, hidden[c])
                out = _softmax_stats(logits, targets[c], spec.return_entropy)
                del logits  # (a non-Linear head's [C, V] output: not alive next to the next one)
            logps[c], lse[c] = out[0], out[1]
            if entropy is not None:
                entropy[c] = out[2]
        # Intermediates, not inputs or outputs: kept on ctx, dropped once used.
        ctx.eager = (grad_h, grad_params) if eager else None
        if entropy is None:
            ctx.save_for_backward(hidden, targets, lse, *params)
            return logps
        ctx.save_for_backward(hidden, targets, lse, entropy, *params)
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor | None, grad_entropy: Tensor | None = None):
        spec: _HeadSpec = ctx.spec
        saved = ctx.saved_tensors
        hidden, targets, lse = saved[:3]
        entropy = saved[3] if spec.return_entropy else None
        params = saved[len(saved) - spec.n_params :]
        eager, ctx.eager = ctx.eager, None  # a second backward (retain_graph) recomputes
        if eager is not None and grad_entropy is None and grad_logps is not None:
            scale = grad_logps[:1]
            # One sync per backward: whether the caller kept its promise decides the route.
            if bool((grad_logps == scale).all()):
                grad_h, grad_params = eager
                grad_h = grad_h.mul_(scale.to(grad_h.dtype)) if grad_h is not None else None
                grad_params = [
                    g.mul_(scale.to(g.dtype)) if g is not None else None for g in grad_params
                ]
                return (grad_h, None, None, *grad_params)
        if grad_logps is None:
            grad_logps = torch.zeros_like(lse)
        grads = _recompute_backward(
            ctx, hidden, targets, lse, entropy, params, grad_logps, grad_entropy
        )
        return (*grads,)


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


def _accumulate(total: list[Tensor | None], wanted: list[int], grads: list) -> None:
    """Sum one chunk's parameter gradients into ``total`` (in place after the first chunk)."""
    for i, g in zip(wanted, grads):
        if g is not None:
            total[i] = g if total[i] is None else total[i].add_(g)


def _chunk_gradients(
    spec: _HeadSpec,
    weight: Tensor | None,
    autocast: tuple[bool, torch.dtype],
    hidden: Tensor,
    c: slice,
    grad_of_logits: Any,
    need_h: bool,
    params: tuple[Tensor, ...],
    wanted: list[int],
    grad_h: Tensor | None,
    grad_params: list[Tensor | None],
) -> None:
    """One chunk's logits, ``dL/dlogits = grad_of_logits(logits, out)``, and its gradients:
    written into ``grad_h[c]`` and summed into ``grad_params``. The eager forward and the
    recompute backward differ only in ``grad_of_logits``.

    A bare Linear head (``weight``: :func:`_plain_weight`) runs by hand in the workspace,
    ``dL/dlogits`` over its logits (``out`` is ``logits``); any other head (``weight`` None) runs
    under autograd in ``autocast``'s state, ``dL/dlogits`` into a fresh ``out`` (the head's graph
    may hold on to its output).
    """
    if weight is not None:
        logits = _linear_logits(spec.head, hidden[c], weight)
        grad = grad_of_logits(logits, logits)
        grads = _linear_grads(spec.head, grad, weight, hidden[c], need_h, params, wanted)
    else:
        enabled, dtype = autocast
        with torch.enable_grad(), torch.autocast(spec.device_type, dtype=dtype, enabled=enabled):
            h = hidden[c].detach().requires_grad_(need_h)
            logits = _head_logits(spec.head, spec.transforms, h)
        z = logits.detach()
        grad = grad_of_logits(z, torch.empty_like(z, memory_format=torch.contiguous_format))
        inputs = ([h] if need_h else []) + [params[i] for i in wanted]
        grads = list(torch.autograd.grad(logits, inputs, grad, allow_unused=True)) if inputs else []
    if need_h:
        grad_h[c] = grads.pop(0)
    _accumulate(grad_params, wanted, grads)


def _recompute_backward(
    ctx: Any,
    hidden: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    params: tuple[Tensor, ...],
    grad_logps: Tensor,
    grad_entropy: Tensor | None,
) -> list[Tensor | None]:
    """:class:`_HeadLogps`' recompute route: the gradients of all its inputs, chunk by chunk."""
    spec: _HeadSpec = ctx.spec
    need_h = ctx.needs_input_grad[0]
    wanted = [i for i in range(len(params)) if ctx.needs_input_grad[3 + i]]
    grad_hidden = torch.empty_like(hidden) if need_h else None
    grad_params: list[Tensor | None] = [None] * len(params)
    weight = _plain_weight(spec, ctx.autocast)
    with contextlib.ExitStack() as stack:
        if ctx.rng is not None:  # replay the forward's dropout masks, chunks in forward order
            devices = [hidden.device] if hidden.device.type != "cpu" else []
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(ctx.rng[0])
            _set_device_rng_state(hidden.device, ctx.rng[1])
        for start in range(0, hidden.shape[0], spec.chunk_size):
            c = slice(start, min(start + spec.chunk_size, hidden.shape[0]))
            ge = grad_entropy[c] if grad_entropy is not None else None
            ent = entropy[c] if entropy is not None else None

            def grad_of_logits(logits: Tensor, out: Tensor, c=c, ent=ent, ge=ge) -> Tensor:
                return _grad_logits(logits, targets[c], lse[c], ent, grad_logps[c], ge, out)

            _chunk_gradients(
                spec, weight, ctx.autocast, hidden, c, grad_of_logits, need_h, params, wanted,
                grad_hidden, grad_params,
            )  # fmt: skip
    return [grad_hidden, None, None, *grad_params]


def _device_rng_state(device: torch.device) -> Tensor | None:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_device_rng_state(device: torch.device, state: Tensor | None) -> None:
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
