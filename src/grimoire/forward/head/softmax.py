"""The softmax math of the LM head: per-row statistics and closed-form logit gradients.

With ``z`` a row of logits, ``p = softmax(z)``, ``t`` its target and ``H`` its entropy:
``log p_t = z_t - lse(z)``, ``dlogp_t/dz = onehot(t) - p`` and ``dH/dz = -p * (log p + H)``.
Everything runs in fp32, in place, one row block at a time, so a chunk's fp32 temporaries stay
bounded (:data:`_FP32_BLOCK_ELEMS`) whatever the chunk size and the logits' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grimoire.forward.head.workspace import _scratch

#: fp32 work on ``[rows, V]`` logits is done this many elements at a time (128 MiB temporaries),
#: so a chunk's fp32 copies never add up to ``chunk_size x V x 4`` bytes, while the head matmul
#: still runs on the whole chunk (big matmuls are what's efficient).
_FP32_BLOCK_ELEMS = 1 << 25


def _row_blocks(rows: int, vocab: int) -> list[slice]:
    """Slices of ``rows`` of at most :data:`_FP32_BLOCK_ELEMS` elements each (at least one row)."""
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
        e = unit_grad[rows] if fp32_out and unit_grad is not None else z
        torch.sub(z, m, out=e)  # z - m (e may alias z: elementwise, so that is safe)
        shifted = e.clone() if entropy is not None else None
        total = e.exp_().sum(-1, keepdim=True)
        log_total = total.log()
        lse[rows] = (m + log_total).squeeze(-1)
        logps[rows] = picked - lse[rows]
        if entropy is not None and shifted is not None:  # shifted is kept for the entropy
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
    in_place = out.dtype == torch.float32
    for rows in _row_blocks(logits.shape[0], logits.shape[-1]):
        # log p, written by one op into fresh memory, never an alias of ``logits`` (the head's
        # backward may need it); for an fp32 head straight into ``out``, which skips a copy
        # pass and a temporary per block (the fp32 promotion and subtraction are the same ops
        # as casting first, so the values are bitwise unchanged).
        z = out[rows] if in_place else _fp32_scratch(logits[rows])
        torch.sub(logits[rows], lse[rows].unsqueeze(-1), out=z)  # log p
        g = grad_logps[rows].unsqueeze(-1)
        if entropy is not None and grad_entropy is not None:
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
