"""Pure loss functions of on-policy distillation (:class:`grimoire.losses.distill.DistillMethod`).

Two objectives, both on completions the student sampled itself:

- :func:`sampled_reverse_kl_loss`: the per-token reverse KL on the sampled tokens, optimised with
  a policy-gradient estimator (Thinking Machines, "On-Policy Distillation", 2025; TRL's
  on-policy distillation; Agarwal et al., GKD, arXiv 2306.13649, with ``beta = 1``). Needs only
  the log-probs of the sampled tokens from both models.
- :func:`generalized_jsd` / :func:`chunked_generalized_jsd`: GKD's generalised Jensen-Shannon
  divergence over the full vocabulary at every completion position (Agarwal et al., eq. 2, as
  TRL's ``GKDTrainer.generalized_jsd_loss``). Needs both models' logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def sampled_reverse_kl_loss(
    logps: Tensor,
    teacher_logps: Tensor,
    mask: Tensor,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed policy-gradient loss of the per-token reverse KL, and the per-token estimates.

    For a completion ``y ~ pi_s`` the reverse KL ``KL(pi_s || pi_t) = E_y[log pi_s(y) - log
    pi_t(y)]`` is minimised with per-token advantages (discount 0, as Thinking Machines' recipe)::

        k_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)          (the sampled-token estimate)
        A_t = -k_t                                                 (detached)
        loss = sum_t m_t * w_t * ( -A_t * exp(log pi_s(y_t) - sg[log pi_s(y_t)]) )

    The ratio is 1 in value, so ``loss = sum_t m_t w_t k_t`` (the summed reverse-KL estimate) and
    ``d loss = sum_t m_t w_t k_t * d log pi_s(y_t)`` (REINFORCE with reward ``-k_t``; the
    ``E[d log pi_s] = 0`` term of the exact gradient is left out, as in the papers).
    ``weights``: truncated importance weights when another engine sampled (vLLM), else None.

    Shapes: ``logps`` (with grad), ``teacher_logps``, ``mask``, ``weights`` ``[N, C]`` ->
    ``(loss_sum [] , k [N, C] detached, 0 where masked)``.
    """
    mask = mask.to(logps.dtype)
    k = (logps.detach() - teacher_logps.to(logps.dtype)) * mask
    ratio = torch.exp(logps - logps.detach())
    per_token = k * ratio * mask
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum(), k


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float) -> Tensor:
    """Per-position generalised JSD of GKD (Agarwal et al., arXiv 2306.13649, eq. 2)::

        M = beta * p_t + (1 - beta) * p_s
        JSD_beta = beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)

    At the end points the definition is 0 (``M`` equals one of the two), so there, as in GKD and
    TRL's ``GKDTrainer.generalized_jsd_loss``, the limits of ``JSD_beta / beta`` (resp.
    ``/ (1 - beta)``) are used: ``beta = 0 -> KL(p_t || p_s)`` (forward KL) and ``beta = 1 ->
    KL(p_s || p_t)`` (reverse KL). Temperature is applied by the caller. Computed in float32.

    Shapes: ``student_logits, teacher_logits [..., V]`` -> ``[...]``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    kl_t = (t.exp() * (t - m)).sum(-1)
    kl_s = (s.exp() * (s - m)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def chunked_generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    beta: float,
    chunk_size: int = 1024,
) -> Tensor:
    """:func:`generalized_jsd` over rows ``chunk_size`` at a time, each chunk checkpointed.

    The log-softmaxes, the mixture and the products are ``[rows, V]`` float32 tensors each; here
    only one chunk's exist at a time, in the forward and (recomputed) in the backward, so the
    extra memory is ``~5 x chunk_size x V`` floats on top of the two logits tensors themselves.

    Shapes: ``student_logits, teacher_logits [M, V]`` -> ``[M]``.
    """
    out = []
    for start in range(0, student_logits.shape[0], chunk_size):
        s = student_logits[start : start + chunk_size]
        t = teacher_logits[start : start + chunk_size]
        if s.requires_grad:
            out.append(checkpoint(generalized_jsd, s, t, beta, use_reentrant=False))
        else:
            out.append(generalized_jsd(s, t, beta))
    if not out:
        return student_logits.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)


__all__ = ["chunked_generalized_jsd", "generalized_jsd", "sampled_reverse_kl_loss"]
