"""KTO's math, on already-reduced sequence log-probs: the loss and its reference point.

Stage: the pure math under :class:`grimoire.losses.kto.KTOLoss` (which computes the log-probs and
the cross-rank reduction). Unlike the pairwise methods of :mod:`grimoire.losses.functional`, a
KTO batch mixes desirable and undesirable rows, so :func:`kto_loss` returns sums and counts
(TRL's ``rewards/chosen_sum`` / ``count/chosen`` convention), which aggregate correctly across
micro-batches and ranks even when a micro-batch holds no row of one kind. All math runs in
float32, as in :mod:`grimoire.losses.functional`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grimoire.losses.checks import Metrics, _check_shapes, _check_weight, _checked_f32, _f32


def kto_kl_estimate(
    policy_mismatched_logps: Tensor,
    ref_mismatched_logps: Tensor,
    reduce_fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    r"""KTO's reference point ``z0``: a batch estimate of ``KL(pi || pi_ref)``, detached, >= 0.

    Paper: Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv 2402.01306 (section 4.1)::

        z0 = max(0, mean_j [log pi(y'_j | x_j) - log pi_ref(y'_j | x_j)])

    over MISMATCHED pairs ``(x_j, y'_j)`` (each prompt with another row's completion, i.e. the
    batch's completions shifted by one), so the estimate is not biased by the very completions
    being scored. Pass SUMMED log-probs, like :func:`kto_loss`. It is detached: gradients through
    ``z0`` destabilise training (paper) and TRL detaches too.

    ``reduce_fn`` (optional) maps this rank's scalar mean to the global one BEFORE the clamp, as
    TRL does (``gather(kl).mean().clamp(min=0)``), e.g. ``lambda t: accelerator.gather(t).mean()``.
    That mean of rank means equals the global mean only for equal per-rank counts; the caller may
    pass a sum/count all-reduce instead. Collective ops are the caller's job.

    Shapes: ``[M]``, ``[M]`` -> scalar float32 (0-d) tensor.
    """
    _check_shapes(
        policy_mismatched_logps=policy_mismatched_logps, ref_mismatched_logps=ref_mismatched_logps
    )
    if policy_mismatched_logps.numel() == 0:
        raise ValueError("kto_kl_estimate needs at least one mismatched pair (got an empty batch)")
    p, ref = _f32(policy_mismatched_logps, ref_mismatched_logps)
    kl = (p - ref).mean().detach()
    if reduce_fn is not None:
        kl = reduce_fn(kl).float().reshape(())
    # Clamp after the cross-rank mean: clamping per rank first would bias the estimate upwards.
    return kl.clamp(min=0).detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    is_desirable: Tensor,
    kl: Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Metrics]:
    r"""KTO: prospect-theoretic value of each unpaired example against the reference point ``kl``.

    Paper: Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv 2402.01306 (as implemented by TRL). With ``r = policy - ref``, ``z0 = kl``::

        desirable:   w_d * (1 - sigma(beta * (r - z0)))
        undesirable: w_u * (1 - sigma(beta * (z0 - r)))

    Pass SUMMED log-probs (paper and TRL). ``kl`` comes from :func:`kto_kl_estimate` (already
    detached, cross-rank reduced and clamped by the caller; it is detached again here so no
    gradient can flow through it). The paper recommends weights with
    ``w_d * n_desirable / (w_u * n_undesirable)`` in ``[1, 4/3]``.

    Args:
        policy_logps, ref_logps: ``[B]`` sequence log-probs of each row's own completion.
        is_desirable: ``[B]`` bool, True for desirable ("chosen") rows.
        kl: scalar reference point ``z0`` (0-d or 1-element tensor, or float).

    Returns:
        ``losses [B]`` in the input order (the mean equals TRL's mean over its chosen-then-rejected
        concatenation), and scalar metrics (sums + counts, so the caller can aggregate
        micro-batches/ranks that lack one kind): ``rewards/chosen_sum``, ``rewards/rejected_sum``
        (sum of ``beta * r`` over desirable / undesirable rows), ``logps/chosen_sum``,
        ``logps/rejected_sum`` (policy), ``count/chosen``, ``count/rejected``, ``kl``.
    """
    _check_shapes(policy_logps=policy_logps, ref_logps=ref_logps, is_desirable=is_desirable)
    if is_desirable.dtype != torch.bool:
        raise ValueError(f"is_desirable must be a bool tensor, got {is_desirable.dtype}")
    p, ref = _checked_f32(beta, policy_logps=policy_logps, ref_logps=ref_logps)
    _check_weight(desirable_weight, "desirable_weight")
    _check_weight(undesirable_weight, "undesirable_weight")
    z0 = torch.as_tensor(kl, dtype=torch.float32, device=p.device).detach()
    if z0.numel() != 1:
        raise ValueError(f"kl must be a scalar, got shape {tuple(z0.shape)}")
    z0 = z0.reshape(())
    r = p - ref
    chosen_losses = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    rejected_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    # Both branches are finite everywhere, so torch.where's masked gradients are exact.
    losses = torch.where(is_desirable, chosen_losses, rejected_losses)

    rewards = (beta * r).detach()
    zero = torch.zeros((), dtype=torch.float32, device=p.device)
    undesirable = ~is_desirable
    metrics: Metrics = {
        "rewards/chosen_sum": torch.where(is_desirable, rewards, zero).sum(),
        "rewards/rejected_sum": torch.where(undesirable, rewards, zero).sum(),
        "logps/chosen_sum": torch.where(is_desirable, p.detach(), zero).sum(),
        "logps/rejected_sum": torch.where(undesirable, p.detach(), zero).sum(),
        "count/chosen": is_desirable.sum().float(),
        "count/rejected": undesirable.sum().float(),
        "kl": z0,
    }
    return losses, metrics


__all__ = ["kto_kl_estimate", "kto_loss"]
