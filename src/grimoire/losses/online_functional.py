"""Pure math of the online RL methods (GRPO / DAPO / Dr. GRPO / GSPO / CISPO, RLOO, Online DPO,
RAFT).

No models here: rewards, per-token log-probs and masks in, advantages / losses / selections
out, so each piece is unit-tested against a naive Python reference.

Layout conventions (from :class:`grimoire.rollout.engines.base.Rollout`): ``N = num_prompts * G``
completions, **prompt-major** (rows ``g*G .. g*G+G-1`` are group ``g``); per-token tensors are
``[N, C]`` over completion tokens with a ``mask [N, C]`` (1 = real completion token).

The reward statistics the rollout stage reports too (:func:`equal_reward_groups`,
:func:`reward_std`) live in :mod:`grimoire.rollout.rewards.statistics` and are re-exported here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grimoire.rollout.rewards.statistics import equal_reward_groups, reward_groups, reward_std

#: GRPO loss types accepted by :func:`reduce_token_loss`: four normalisations of PPO's clipped
#: surrogate, and CISPO's surrogate (normalised as "dapo", as TRL does).
LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
#: Where the importance ratio lives (:func:`importance_ratio`): per token, or GSPO's per sequence.
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
#: Advantage scalings accepted by :func:`group_advantages`.
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    batch_std: Tensor | float | None = None,
) -> Tensor:
    r"""GRPO's group-relative advantages.

    Paper: Shao et al., "DeepSeekMath", arXiv 2402.03300 (sec. 4.1.2, outcome supervision)::

        A_i = (r_i - mean_group(r)) / (std + eps)

    ``scale_rewards`` picks ``std``: ``"group"`` (the paper: the group's std), ``"batch"`` (the
    std of all rewards of the batch, as TRL/PPO-style whitening; ``batch_std`` lets the caller
    pass a cross-rank value) or ``"none"`` (no division; Liu et al., "Understanding R1-Zero-Like
    Training: A Critical Perspective" (Dr. GRPO), arXiv 2503.20783, who show the std division
    up-weights too-easy / too-hard prompts). Stds are unbiased (Bessel, ``torch.std``), as TRL.
    A group whose rewards are all equal gets ``A = 0`` whatever the scaling.

    Shapes: ``rewards [N]`` -> ``[N]`` float32.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    r = reward_groups(rewards, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centered = centered / (r.std(dim=1, keepdim=True) + eps) if group_size > 1 else centered
    elif scale_rewards == "batch":
        std = r.flatten().std() if batch_std is None else torch.as_tensor(batch_std).float()
        centered = centered / (std.to(centered.device) + eps)
    return centered.flatten()


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    r"""REINFORCE leave-one-out advantages.

    Paper: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs", arXiv 2402.14740 (sec. 3; baseline from Kool et al. 2019)::

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_group(r))

    Shapes: ``rewards [N]`` -> ``[N]`` float32. Needs ``G >= 2``.
    """
    if group_size < 2:
        raise ValueError(
            f"RLOO needs group_size >= 2 for a leave-one-out baseline, got {group_size}"
        )
    r = reward_groups(rewards, group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).flatten()


def importance_ratio(
    logps: Tensor, old_logps: Tensor, mask: Tensor | None = None, level: str = "token"
) -> Tensor:
    r"""The importance ratio of the current policy to the one that sampled, per token or per sequence.

    ``level="token"`` (PPO, GRPO): ``r_it = exp(logp_it - old_logp_it)``, shape ``[N, C]``.

    ``level="sequence"``: GSPO's length-normalised sequence ratio (Zheng et al., "Group Sequence
    Policy Optimization", arXiv 2507.18071, eq. 7), the geometric mean of the token ratios::

        s_i = (pi(y_i | x) / pi_old(y_i | x)) ** (1 / |y_i|)
            = exp( 1/|y_i| * sum_t M_it (logp_it - old_logp_it) )              shape [N, 1]

    Differentiable in ``logps``: ``d s_i / d logp_it = s_i M_it / |y_i|``, the paper's gradient
    (its gradient analysis: every token of ``y_i`` weighted equally, by ``s_i A_i / |y_i|``),
    with no stop-gradient needed. A row with an empty mask gets ``s_i = 1``. Needs
    ``mask [N, C]`` at the sequence level.
    """
    log_ratio = logps.float() - old_logps.float()
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        if mask is None:
            raise ValueError("importance_ratio(level='sequence') needs the completion mask")
        m = mask.to(log_ratio.dtype)
        mean_log = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        return torch.exp(mean_log)
    raise ValueError(
        f"importance_sampling_level must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, "
        f"got {level!r}"
    )


def clipped_surrogate(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    mask: Tensor | None = None,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""PPO's clipped surrogate, with DAPO's decoupled (asymmetric) clip range and GSPO's
    sequence-level ratio.

    Papers: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (eq. 7);
    clip-higher from Yu et al., "DAPO", arXiv 2503.14476 (sec. 3.1, ``eps_high = 0.28``)::

        ratio = exp(logp - old_logp)                                     (level="token")
        loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

    With ``level="sequence"`` the ratio is GSPO's ``s_i`` (:func:`importance_ratio`; Zheng et
    al., arXiv 2507.18071, eq. 5-7): one clipped term per sequence, ``-min(s_i A_i, clip(s_i,
    1 - eps_low, 1 + eps_high) A_i)``, repeated on each of its tokens, so the per-sequence token
    mean (``loss_type="grpo"``) is exactly the paper's objective. GSPO's paper clips at
    ``eps_low = 3e-4``, ``eps_high = 4e-4``, as a sequence ratio sits much closer to 1.

    A token (a sequence, at the sequence level) whose ratio is already past the clip edge in
    the direction the advantage pushes (``ratio > 1 + eps_high`` with ``A > 0``, or ``ratio <
    1 - eps_low`` with ``A < 0``) takes the constant clipped branch, so it contributes NO
    gradient.

    Shapes: ``logps, old_logps [N, C]``, ``advantages [N]`` (``mask [N, C]``, needed at the
    sequence level) -> per-token loss ``[N, C]`` (not masked) and detached ``ratio``,
    ``clipped_low``, ``clipped_high`` (bool: exactly the zero-gradient terms), ``[N, C]`` at the
    token level, ``[N, 1]`` at the sequence level.
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    a = advantages.float().unsqueeze(1)
    ratio = importance_ratio(logps, old_logps, mask, level)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    loss = -torch.min(ratio * a, clipped * a)
    r = ratio.detach()
    info = {
        "ratio": r,
        "clipped_low": (r < 1 - epsilon_low) & (a < 0),
        "clipped_high": (r > 1 + eps_high) & (a > 0),
    }
    return loss.expand(logps.shape), info


def cispo_surrogate(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    epsilon_max: float,
    mask: Tensor | None = None,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""CISPO: REINFORCE with a clipped, stop-gradient importance-sampling weight per token.

    Paper: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv 2506.13585 (sec. 3.1); the cap's name from Khatri et al., "The
    Art of Scaling Reinforcement Learning Compute for LLMs" (ScaleRL), arXiv 2510.13786::

        w_it  = sg( min(r_it, eps_max) )          r_it = exp(logp_it - old_logp_it)
        loss  = -w_it * A_i * logp_it

    PPO's clip drops a token's gradient when its ratio leaves the trust region; CISPO keeps
    every token's gradient and bounds only the weight (``d loss / d logp_it = -w_it A_i``), so
    rare tokens that fork the reasoning still learn. MiniMax-M1 writes the bound as
    ``1 + eps_high^IS`` and sets no lower one; here (as TRL) ``epsilon_max`` is the bound on
    the ratio itself (ScaleRL and TRL suggest 5.0). With ``level="sequence"`` the weight is
    GSPO's sequence ratio ``s_i`` instead (TRL allows the combination).

    Shapes: ``logps, old_logps [N, C]``, ``advantages [N]`` -> per-token loss ``[N, C]`` (not
    masked) and detached ``ratio``, ``clipped_low`` (all False: no lower bound) and
    ``clipped_high`` (weight capped with ``A > 0``, TRL's ``cispo_clip_ratio``), ``[N, C]`` or
    ``[N, 1]`` by level.
    """
    a = advantages.float().unsqueeze(1)
    ratio = importance_ratio(logps, old_logps, mask, level).detach()
    weight = torch.clamp(ratio, max=epsilon_max)
    loss = -weight * a * logps.float()
    info = {
        "ratio": ratio,
        "clipped_low": torch.zeros_like(ratio, dtype=torch.bool),
        "clipped_high": (ratio > epsilon_max) & (a > 0),
    }
    return loss, info


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    r"""Per-token ``KL(pi || pi_ref)`` estimator "k3" (unbiased, always >= 0).

    Schulman, "Approximating KL Divergence" (blog, 2020); used by DeepSeekMath eq. 4::

        d = ref_logp - logp;   kl = exp(d) - d - 1

    Shapes: ``[N, C]`` -> ``[N, C]`` float32 (differentiable in ``logps``).
    """
    d = ref_logps.float() - logps.float()
    return torch.exp(d) - d - 1


def reduce_token_loss(
    per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int | None = None
) -> Tensor:
    r"""Reduce a per-token loss of ONE micro-batch; pair with :func:`reduction_units`.

    The trainer multiplies each micro-batch's loss by ``units / sum(units over the global step,
    all ranks)``; with these pairs the optimizer step minimises (``M`` = mask, sums over the
    global batch, ``n`` = sequences with at least one token, ``L`` = max_completion_length)::

        loss_type   micro-batch loss                 units        global objective
        "dapo"      sum(l M) / sum(M)                sum(M)       sum(l M) / sum(M)   (token mean)
        "cispo"     as "dapo" (MiniMax-M1 eq. 4 normalises by all tokens of the batch, as TRL)
        "grpo"      mean_i[sum_t(l M)_i / |o_i|]     n            mean over sequences of
                                                                   the per-sequence token mean
        "bnpo"      sum(l M) / sum(M)                1            mean over micro-batches of
                                                                   their token means (TRL)
        "dr_grpo"   sum(l M) / (n * L)               n            sum(l M) / (N * L)

    "grpo" is DeepSeekMath eq. 3; "dapo" is DAPO's token-level loss (arXiv 2503.14476 sec. 3.3),
    normalised over the *global* batch; "dr_grpo" is Dr. GRPO's constant normaliser
    (arXiv 2503.20783), which removes the length bias of the per-sequence mean; "bnpo" is TRL's
    local-batch token mean.

    Shapes: ``per_token, mask [N, C]`` -> scalar. Rows with an all-zero mask (dropped groups /
    padding rows) count in no normaliser.
    """
    m = mask.to(per_token.dtype)
    total = (per_token * m).sum()
    if loss_type in ("dapo", "cispo", "bnpo"):
        return total / m.sum().clamp(min=1.0)
    n_seq = (m.sum(-1) > 0).sum().clamp(min=1)
    if loss_type == "grpo":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / n_seq
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return total / (n_seq * max_completion_length)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def reduction_units(mask: Tensor, loss_type: str) -> float:
    """The micro-batch's weight for the trainer's global normalisation (see
    :func:`reduce_token_loss`): tokens ("dapo", "cispo"), sequences ("grpo", "dr_grpo") or 1 ("bnpo";
    0 for a micro-batch without any token)."""
    tokens = float(mask.sum())
    if loss_type in ("dapo", "cispo"):
        return tokens
    if loss_type in ("grpo", "dr_grpo"):
        return float((mask.sum(-1) > 0).sum())
    if loss_type == "bnpo":
        return 1.0 if tokens > 0 else 0.0
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def best_worst_pairs(rewards: Tensor, group_size: int, atol: float = 0.0) -> list[tuple[int, int]]:
    """Online DPO pairs: per group, (index of the best, index of the worst) completion.

    Paper: Guo et al., "Direct Language Model Alignment from Online AI Feedback" (OAIF),
    arXiv 2402.04792, with G > 2 samples paired best-vs-worst as in Xu et al. / Llama-3's
    rejection-sampled preference data. Ties (``best - worst <= atol``) carry no preference and
    are skipped. The first index wins among equal maxima / minima. Indices are global rows of
    ``rewards [N]``.
    """
    r = reward_groups(rewards, group_size)
    pairs = []
    for g in range(r.shape[0]):
        best, worst = int(r[g].argmax()), int(r[g].argmin())
        if float(r[g, best] - r[g, worst]) > atol:
            pairs.append((g * group_size + best, g * group_size + worst))
    return pairs


def best_of_n(rewards: Tensor, group_size: int, reward_threshold: float | None = None) -> list[int]:
    """RAFT winners: per group, the highest-reward completion, kept if ``>= reward_threshold``.

    Paper: Dong et al., "RAFT: Reward rAnked FineTuning for Generative Foundation Model
    Alignment", arXiv 2304.06767 (best-of-K per prompt, then SFT on the winners). Returns global
    row indices; the first index wins among equal maxima.
    """
    r = reward_groups(rewards, group_size)
    out = []
    for g in range(r.shape[0]):
        best = int(r[g].argmax())
        if reward_threshold is None or float(r[g, best]) >= reward_threshold:
            out.append(g * group_size + best)
    return out


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty), detached float32."""
    m = mask.to(torch.float32)
    return ((values.detach().float() * m).sum() / m.sum().clamp(min=1.0)).detach()


__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "best_of_n",
    "best_worst_pairs",
    "cispo_surrogate",
    "clipped_surrogate",
    "equal_reward_groups",
    "group_advantages",
    "importance_ratio",
    "k3_kl",
    "masked_mean",
    "reduce_token_loss",
    "reduction_units",
    "reward_std",
    "rloo_advantages",
]
