"""The LM head's autograd Function: per-row log-probs of ``[rows, V]`` logits, chunk by chunk.

Stage: the second half of the forward stage's fused path.
:func:`grimoire.forward.fused_head.fused_token_logps` gathers the rows that have a target and
calls :class:`_HeadLogps` on them. This module holds the Function and its two routes to the
head's gradients (recompute in backward, or eager in the forward for a token-mean loss), with
RNG replay for heads that draw random numbers; the softmax math is in
:mod:`~grimoire.forward.head.softmax`, the bare-Linear fast path in
:mod:`~grimoire.forward.head.linear`. See ``docs/fused-logprobs.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from grimoire.forward.head.linear import _linear_grads, _linear_logits, _plain_weight
from grimoire.forward.head.softmax import _grad_logits, _softmax_stats


def _head_logits(head: torch.nn.Module, transforms: list, hidden: Tensor) -> Tensor:
    """``transforms(head(hidden))`` in the head's output dtype: ``[N, H] -> [N, V]``."""
    logits = head(hidden)
    for fn, value in transforms:
        logits = fn(logits, value)
    return logits


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


class PromiseChecks:
    """Where the eager route's backward passes record, ON THE DEVICE, whether the upstream
    gradients were all equal, instead of reading that back (a host sync inside every backward).

    Inside :func:`deferred_promise_checks` the eager route is taken on trust and ``broken``
    accumulates a device flag; whoever opened the scope reads it with its own transfer (the
    trainer: with the step's metrics) and must fail if it is set. Outside such a scope, backward
    reads the flag itself and falls back to the exact recompute when it is set.
    """

    def __init__(self) -> None:
        self.broken: Tensor | None = None  # a device bool scalar, once any backward ran

    def record(self, broken: Tensor) -> None:
        self.broken = broken if self.broken is None else self.broken | broken


# The open scope, if any. A plain global, not a thread-local: backward may run on an autograd
# worker thread; each forward captures the scope open when it ran.
_DEFERRED: PromiseChecks | None = None


@contextlib.contextmanager
def deferred_promise_checks() -> Iterator[PromiseChecks]:
    """Backward passes of head forwards run inside this scope check ``uniform_grad`` on the
    device only (see :class:`PromiseChecks`)."""
    global _DEFERRED
    outer, _DEFERRED = _DEFERRED, PromiseChecks()
    try:
        yield _DEFERRED
    finally:
        _DEFERRED = outer


def _chunk_stats(
    spec: _HeadSpec, weight: Tensor | None, hidden: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's ``(logps, lse, entropy)`` from its logits, without gradients (the recompute
    route's forward). The ``[C, V]`` logits are this function's local, so they are freed on
    return, before the next chunk's exist."""
    if weight is not None:  # only for a bare Linear head (_plain_weight)
        logits = _linear_logits(cast(torch.nn.Linear, spec.head), hidden, weight)
    else:
        logits = _head_logits(spec.head, spec.transforms, hidden)
    return _softmax_stats(logits, targets, spec.return_entropy)


def _needs_rng_replay(head: torch.nn.Module) -> bool:
    """Does the head draw random numbers (e.g. LoRA dropout on lm_head in training mode)?"""
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
        for m in head.modules()
    )


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
      head (by hand for a bare Linear,
      :func:`~grimoire.forward.head.linear._plain_linear`; else with ``torch.autograd.grad``,
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
      promise costs time, never exactness. Inside :func:`deferred_promise_checks` (the
      trainer's step) the check stays on the device: the hidden states' gradient is scaled per
      row (exact whatever the grads), the parameters' by the first grad, and a broken promise
      is a flag the scope's owner reads later and fails on.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, targets: Tensor, spec: _HeadSpec, *params: Tensor):
        dev = spec.device_type
        ctx.spec = spec
        # Unused outputs (typically a logged-only entropy) come back as None: skip their math.
        ctx.set_materialize_grads(False)
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.checks = _DEFERRED
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
        weight = _plain_weight(spec.head, spec.transforms, ctx.autocast)
        for start in range(0, n, spec.chunk_size):
            c = slice(start, min(start + spec.chunk_size, n))
            if eager:
                stats: list = []  # the statistics come out of the gradient's own pass

                def unit_grad(logits: Tensor, out: Tensor, c: slice = c, stats=stats) -> Tensor:
                    stats.append(_softmax_stats(logits, targets[c], spec.return_entropy, out))
                    return out

                _chunk_gradients(
                    spec,
                    weight,
                    ctx.autocast,
                    hidden,
                    c,
                    unit_grad,
                    need_h,
                    params,
                    wanted,
                    grad_h,
                    grad_params,
                )
                out = stats[0]
            else:
                out = _chunk_stats(spec, weight, hidden[c], targets[c])
            logps[c], lse[c] = out[0], out[1]
            if entropy is not None:
                chunk_entropy = out[2]
                assert chunk_entropy is not None, "return_entropy asks _softmax_stats for it"
                entropy[c] = chunk_entropy
        # Intermediates, not inputs or outputs: kept on ctx, dropped once used.
        ctx.eager = (grad_h, grad_params) if eager else None
        if entropy is None:
            ctx.save_for_backward(hidden, targets, lse, *params)
            return logps
        ctx.save_for_backward(hidden, targets, lse, entropy, *params)
        return logps, entropy

    @staticmethod
    # torch types backward as (ctx, *grad_outputs); it is called with one grad per output.
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad_logps: Tensor | None, grad_entropy: Tensor | None = None
    ):
        spec: _HeadSpec = ctx.spec
        saved = ctx.saved_tensors
        hidden, targets, lse = saved[:3]
        entropy = saved[3] if spec.return_entropy else None
        params = saved[len(saved) - spec.n_params :]
        eager, ctx.eager = ctx.eager, None  # a second backward (retain_graph) recomputes
        if eager is not None and grad_entropy is None and grad_logps is not None:
            scale = grad_logps[:1]
            uniform = (grad_logps == scale).all()
            if ctx.checks is not None:  # checked on the device, read later by the scope's owner
                ctx.checks.record(~uniform)
            # Outside a deferred scope, one sync per backward decides the route.
            if ctx.checks is not None or bool(uniform):
                grad_h, grad_params = eager
                if grad_h is not None:  # per row: exact for any upstream grads
                    grad_h = grad_h.mul_(grad_logps[:, None].to(grad_h.dtype))
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


def _accumulate(total: list[Tensor | None], wanted: list[int], grads: list) -> None:
    """Sum one chunk's parameter gradients into ``total`` (in place after the first chunk)."""
    for i, g in zip(wanted, grads):
        if g is not None:
            sum_so_far = total[i]
            total[i] = g if sum_so_far is None else sum_so_far.add_(g)


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

    A bare Linear head (``weight``: :func:`~grimoire.forward.head.linear._plain_weight`) runs
    by hand in the workspace, ``dL/dlogits`` over its logits (``out`` is ``logits``); any other
    head (``weight`` None) runs under autograd in ``autocast``'s state, ``dL/dlogits`` into a
    fresh ``out`` (the head's graph may hold on to its output).
    """
    if weight is not None:
        head = cast(torch.nn.Linear, spec.head)  # a weight is given only for a bare Linear
        logits = _linear_logits(head, hidden[c], weight)
        grad = grad_of_logits(logits, logits)
        grads = _linear_grads(head, grad, weight, hidden[c], need_h, params, wanted)
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
        g_h = grads.pop(0)
        assert grad_h is not None and g_h is not None, "need_h: a buffer, and h feeds the logits"
        grad_h[c] = g_h
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
    weight = _plain_weight(spec.head, spec.transforms, ctx.autocast)
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
                spec,
                weight,
                ctx.autocast,
                hidden,
                c,
                grad_of_logits,
                need_h,
                params,
                wanted,
                grad_hidden,
                grad_params,
            )
    return [grad_hidden, None, None, *grad_params]


def _device_rng_state(device: torch.device) -> Tensor | None:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_device_rng_state(device: torch.device, state: Tensor | None) -> None:
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
