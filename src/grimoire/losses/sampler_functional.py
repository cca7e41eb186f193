"""Pure math of the correction for a sampler that is not the learner (the online methods).

A separate sampler (vLLM: other kernels, maybe another precision; an asynchronous sampler a few
optimizer steps behind) draws from ``pi_sampler`` while the loss assumes ``pi_old``. Here: the
importance weights of the four modes (TRL's ``vllm_importance_sampling_mode`` names), DeepSeek-
V3.2's off-policy sequence mask, the diagnostics of the mismatch and the settings' checks. The
settings themselves are :mod:`grimoire.losses.sampler_correction`.

Layout as :mod:`grimoire.losses.online_functional`: ``[N, C]`` per-token tensors over
completion tokens with a ``mask [N, C]`` (1 = real completion token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grimoire.losses.online_functional import masked_mean

#: How the sampler/learner mismatch is corrected (:func:`importance_sampling_weights`): the
#: ratio per token or per sequence, truncated to the bounds or masked outside them.
IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)


def sampler_log_ratio(old_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> Tensor:
    """``log(pi_old / pi_sampler)`` per token, detached float32: 0 on padding and where the sampler
    gave no log-prob (NaN; a ratio of 1 there, as TRL). Shapes: ``[N, C]`` -> ``[N, C]``."""
    diff = torch.nan_to_num(old_logps.detach().float() - sampler_logps.detach().float(), nan=0.0)
    return diff * mask.to(diff.dtype)


def importance_sampling_ratio(log_ratio: Tensor, mode: str) -> Tensor:
    r"""The sampler correction's raw ratio at the level of ``mode``, from
    :func:`sampler_log_ratio`'s ``d = log pi_old - log pi_sampler`` (0 on padding)::

        token_*      rho_it = exp(d_it)                       [N, C]
        sequence_*   rho_i  = exp(sum_t d_it)                 [N, 1]

    The sequence ratio is the probability ratio of the whole completion (a product over its
    tokens, not GSPO's length-normalised geometric mean), as TRL's ``sequence_*`` modes and Liu
    et al., "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch" (blog, 2025), whose sequence-level IS is unbiased for the sequence objective.
    """
    _check_mode(mode)
    if mode.startswith("sequence"):
        return torch.exp(log_ratio.sum(-1, keepdim=True))
    return torch.exp(log_ratio)


def importance_sampling_weights(
    old_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
) -> Tensor:
    r"""Importance weights that correct for samples drawn by a sampler that is not the learner.

    A separate sampler (vLLM: other kernels, maybe another precision; an asynchronous sampler a
    few optimizer steps behind) draws from ``pi_sampler`` while the loss assumes ``pi_old``.
    Each token's policy-gradient term is multiplied by a detached weight made from the ratio
    ``rho = pi_old / pi_sampler`` (:func:`importance_sampling_ratio`; ``lo = clip_min``,
    ``hi = clip_max``, ``None`` = no bound on that side)::

        token_truncate     w_it = clip(rho_it, lo, hi)               (TIS, Yao et al. 2025)
        token_mask         w_it = rho_it * 1[lo <= rho_it <= hi]     (MIS, Liu et al. 2025)
        sequence_truncate  w_it = clip(rho_i, lo, hi)
        sequence_mask      w_it = rho_i * 1[lo <= rho_i <= hi]

    Papers: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (blog, 2025) for truncation; Liu et al., "When Speed Kills Stability" (blog, 2025) for the
    masked and sequence-level variants; TRL's ``vllm_importance_sampling_mode`` names them.
    Truncation bounds the variance a token the sampler under-weights brings, masking drops the
    token (sequence) whose ratio is implausible instead of keeping a biased, capped weight.

    Shapes: ``old_logps, sampler_logps, mask [N, C]`` -> detached float32 weights ``[N, C]``
    (a sequence mode's ``[N, 1]`` weight repeated on each token; padding positions carry no
    meaning, the loss masks them).
    """
    ratio = importance_sampling_ratio(sampler_log_ratio(old_logps, sampler_logps, mask), mode)
    if mode.endswith("truncate"):
        weights = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        weights = ratio.masked_fill(_outside(ratio, clip_min, clip_max), 0.0)
    return weights.expand(mask.shape)


def off_policy_sequence_mask(
    advantages: Tensor, logps: Tensor, sampler_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    r"""DeepSeek-V3.2's off-policy sequence mask: drop a sequence the policy gradient would push
    down (``A_i < 0``) whose sampler has drifted too far from the learner.

    Paper: DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556 (sec. 3.1, eq. 9), as TRL's
    ``GRPOTrainer.get_off_policy_mask``; ``delta = threshold``::

        KL_i = 1/|o_i| * sum_t M_it (log pi_sampler(o_it) - log pi_theta(o_it))
        keep_i = 1[A_i >= 0  or  KL_i <= delta]

    ``KL_i`` is the k1 (sampled log-ratio) estimate of ``KL(pi_sampler || pi_theta)`` per token
    (its samples come from the sampler); the current policy's log-probs enter detached. A NaN
    sampler log-prob counts as no evidence (0). Negative samples far off-policy are the ones
    whose gradient is least trustworthy (the paper); positive ones are kept whatever the KL.

    Shapes: ``advantages [N]`` (or ``[N, 1]``), ``logps, sampler_logps, mask [N, C]`` ->
    float32 ``[N, 1]`` (1 keep, 0 drop).
    """
    m = mask.to(torch.float32)
    kl = torch.nan_to_num(sampler_logps.detach().float() - logps.detach().float(), nan=0.0)
    mean_kl = (kl * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    a = advantages.float().reshape(-1, 1)
    return ((a >= 0) | (mean_kl <= threshold)).float()


def sampler_mismatch_metrics(
    old_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
    weights: Tensor | None = None,
) -> dict[str, Tensor]:
    r"""How far the sampler is from the learner, and what the correction of ``mode`` did with it.

    With ``d = log pi_old - log pi_sampler`` on real tokens and ``rho`` the ratio of ``mode``:

    - ``sampling/mismatch_kl``: the token mean of the k3 estimate of ``KL(pi_sampler ||
      pi_old)``, ``exp(d) - d - 1`` (Schulman, "Approximating KL Divergence", 2020): unbiased
      for samples of the sampler, >= 0 per token, 0 exactly when the two agree;
    - ``sampling/sampling_logp_difference/mean``, ``.../max``: ``|d|`` (TRL's names);
    - ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max``: the weights applied
      (:func:`importance_sampling_weights`; over tokens, over sequences in a sequence mode), as
      TRL logs them;
    - ``sampling/importance_sampling_ratio/clipped_frac``: share of tokens whose ratio a
      ``*_truncate`` mode moved to a bound; ``.../masked_frac``: share of tokens a ``*_mask``
      mode zeroed (the tokens of a masked sequence, in ``sequence_mask``).

    ``weights``: :func:`importance_sampling_weights` of the same arguments, where the caller has
    them (computed here otherwise). Shapes: ``[N, C]`` -> detached scalars (an empty mask gives
    0, and ratios of 1).
    """
    d = sampler_log_ratio(old_logps, sampler_logps, mask)
    ratio = importance_sampling_ratio(d, mode)
    if weights is None:  # the caller's, when it computed them for the loss already
        weights = importance_sampling_weights(
            old_logps, sampler_logps, mask, mode, clip_max, clip_min
        )
    beyond = _outside(ratio, clip_min, clip_max).expand(mask.shape).float()
    truncating = mode.endswith("truncate")
    where = mask if mode.startswith("token") else (mask.sum(-1, keepdim=True) > 0)
    real = where.bool()
    applied = weights[:, :1] if mode.startswith("sequence") else weights
    return {
        "sampling/mismatch_kl": masked_mean(torch.expm1(d) - d, mask),
        "sampling/sampling_logp_difference/mean": masked_mean(d.abs(), mask),
        "sampling/sampling_logp_difference/max": _masked_extreme(d.abs(), mask.bool(), True, 0.0),
        "sampling/importance_sampling_ratio/min": _masked_extreme(applied, real, False, 1.0),
        "sampling/importance_sampling_ratio/mean": masked_mean(applied, real),
        "sampling/importance_sampling_ratio/max": _masked_extreme(applied, real, True, 1.0),
        "sampling/importance_sampling_ratio/clipped_frac": masked_mean(beyond * truncating, mask),
        "sampling/importance_sampling_ratio/masked_frac": masked_mean(
            beyond * (not truncating), mask
        ),
    }


def truncated_importance_weights(
    old_logps: Tensor, sampler_logps: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Truncated importance sampling (TIS): :func:`importance_sampling_weights` in its
    ``token_truncate`` mode, ``w_t = min(exp(old_logp_t - sampler_logp_t), cap)``, with
    :func:`sampler_mismatch_metrics`. Shapes: ``[N, C]`` -> detached weights ``[N, C]`` (1 on
    padding) and the metrics."""
    args = (old_logps, sampler_logps, mask, "token_truncate", cap)
    return importance_sampling_weights(*args), sampler_mismatch_metrics(*args)


def check_importance_sampling(
    mode: str,
    clip_max: float | None,
    clip_min: float | None,
    off_policy_mask_threshold: float | None,
) -> list[str]:
    """Every problem of a sampler-correction setting (empty when none), for one error."""
    problems = []
    if mode not in IMPORTANCE_SAMPLING_MODES:
        problems.append(
            f"importance_sampling_mode must be one of {list(IMPORTANCE_SAMPLING_MODES)}, "
            f"got {mode!r}"
        )
    for name, bound in (("clip_max", clip_max), ("clip_min", clip_min)):
        if bound is not None and (isinstance(bound, bool) or not bound >= 0):
            problems.append(f"importance_sampling_{name} must be a number >= 0, got {bound!r}")
    if clip_max is not None and clip_min is not None and not clip_min < clip_max:
        problems.append(
            f"importance_sampling_clip_min ({clip_min}) must be below importance_sampling_"
            f"clip_max ({clip_max})"
        )
    if mode.endswith("truncate") and clip_max is None and clip_min is None:
        problems.append(f"importance_sampling_mode={mode!r} needs a clip_max or a clip_min")
    t = off_policy_mask_threshold
    if t is not None and (isinstance(t, bool) or not t >= 0):
        problems.append(f"off_policy_mask_threshold must be a number >= 0 (nats), got {t!r}")
    return problems


def _check_mode(mode: str) -> None:
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"importance_sampling_mode must be one of {list(IMPORTANCE_SAMPLING_MODES)}, "
            f"got {mode!r}"
        )


def _outside(ratio: Tensor, lo: float | None, hi: float | None) -> Tensor:
    """``ratio < lo`` or ``ratio > hi`` (a ``None`` bound: no bound), bool."""
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if lo is not None:
        out |= ratio < lo
    if hi is not None:
        out |= ratio > hi
    return out


def _masked_extreme(values: Tensor, where: Tensor, largest: bool, empty: float) -> Tensor:
    """The largest (or smallest) of ``values`` over ``where``, ``empty`` if none, detached."""
    picked = values.detach().float()[where.expand(values.shape)]
    if picked.numel() == 0:
        return torch.tensor(empty)
    return picked.max() if largest else picked.min()


__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "check_importance_sampling",
    "importance_sampling_ratio",
    "importance_sampling_weights",
    "off_policy_sequence_mask",
    "sampler_log_ratio",
    "sampler_mismatch_metrics",
    "truncated_importance_weights",
]
