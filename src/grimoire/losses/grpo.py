"""GRPO (and its DAPO / Dr. GRPO / GSPO / CISPO variants): group-relative policy optimisation.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300 (sec. 4). Per prompt, sample ``G`` completions, score them, and use
the group-normalised reward as every token's advantage in PPO's clipped surrogate::

    A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)            (scale_rewards="group")
    ratio_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    l_it     = -min(ratio_it A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) A_i)
               + beta * KL_k3(pi || pi_ref)_it
    loss     = reduce(l, loss_type)            (see online_functional.reduce_token_loss)

Defaults, and why:

- ``loss_type="dapo"``: token-level mean over the *global* batch (DAPO, arXiv 2503.14476,
  sec. 3.3). The paper's per-sequence mean ("grpo") gives each token of a long completion less
  weight, so long wrong answers are under-penalised and lengths drift (also shown by Dr. GRPO,
  arXiv 2503.20783). TRL's current default too.
- ``beta=0.0``: no KL term, so no reference model is loaded or run. DeepSeekMath used 0.04, but
  DAPO (sec. 2.3) and Dr. GRPO drop the KL for verifiable rewards (the policy is *meant* to move
  far from the initial one), and recent practice (TRL's default, Open-Reasoner-Zero) follows;
  it saves a model's memory and a forward per step. Set ``beta=0.04`` for the paper's setting
  or with learned reward models, where the KL guards against reward hacking.
- ``scale_rewards="group"`` (the paper); ``"none"`` is Dr. GRPO's fix for the std's difficulty
  bias; ``"batch"`` divides by the batch std (all ranks).
- ``epsilon=0.2`` (PPO); ``epsilon_high=None`` means symmetric, DAPO's clip-higher uses 0.28.
- ``num_iterations=1`` (mu in DeepSeekMath's Algorithm 1): one update per rollout, so the
  ratio is exactly 1 in value (no extra old-log-prob forward is run). With mu > 1 the trainer
  repeats the batch for mu optimizer steps and the cached rollout's old log-probs make the
  clipping engage.
- ``importance_sampling_level="token"``: the ratio above. ``"sequence"`` is GSPO (Zheng et
  al., arXiv 2507.18071): ``ratio_it`` becomes the sequence's length-normalised ratio
  ``s_i = exp(mean_t(logp_it - old_logp_it))``, clipped once per sequence. Pair it with
  ``loss_type="grpo"`` (the paper's per-sequence mean) and the paper's small clip range
  (``epsilon=3e-4, epsilon_high=4e-4``); the token-summing normalisations weight each
  sequence by its length (a warning says so, as TRL's does).
- ``loss_type="cispo"`` (MiniMax-M1, arXiv 2506.13585): ``l_it = -sg(min(ratio_it, eps_max))
  A_i logp_it``, normalised as "dapo"; ``epsilon_high`` is ``eps_max``, the bound on the ratio
  itself, defaulting to 5.0 (ScaleRL's and TRL's suggestion) for this loss: TRL falls back to
  ``epsilon`` (0.2), a cap that scales every on-policy token's gradient by 0.2.

The KL term and the sampler correction (the importance weight of a sampler that is not the
learner, and DeepSeek-V3.2's off-policy sequence mask: :meth:`OnlineMethod.importance_weights`)
combine with every option as in TRL: the KL stays per token (``use_bias_correction_kl``, on by
default, multiplies it by the ratio of the chosen level) and is added after the weight
multiplied each token's surrogate, so it is not weighted (docs/online-rl.md, "How the options
combine").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.config.context import TrainingContext
from grimoire.losses.online import OnlineMethod
from grimoire.losses.online_functional import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    cispo_surrogate,
    clipped_surrogate,
    equal_reward_groups,
    group_advantages,
    importance_ratio,
    k3_kl,
    masked_mean,
    reduce_token_loss,
    reduction_units,
)
from grimoire.rollout.rewards.calls import RewardSpec
from grimoire.rollout.stage import ScoredGroup

logger = logging.getLogger(__name__)

#: ``epsilon_high`` of ``loss_type="cispo"`` when not given: the IS weight's cap (ScaleRL, TRL).
CISPO_EPSILON_MAX = 5.0
#: Loss types that sum per-token terms, so a sequence-level ratio weights a sequence by length.
_TOKEN_SUMMING = ("dapo", "bnpo", "dr_grpo", "cispo")


def _setting_problems(
    epsilon: float,
    epsilon_high: float | None,
    num_iterations: int,
    loss_type: str,
    scale_rewards: str,
    importance_sampling_level: str,
) -> list[str]:
    """Every GRPO setting out of its range or list, for one error."""
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type must be one of {list(LOSS_TYPES)}, got {loss_type!r}")
    if scale_rewards not in SCALE_REWARDS:
        problems.append(
            f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {scale_rewards!r}"
        )
    if not 0 < epsilon < 1:
        problems.append(f"epsilon must be in (0, 1), got {epsilon}")
    if epsilon_high is not None and not epsilon_high > 0:
        problems.append(f"epsilon_high must be > 0, got {epsilon_high}")
    elif loss_type == "cispo" and epsilon_high is not None and epsilon_high < 1:
        problems.append(
            f"epsilon_high must be >= 1 with loss_type='cispo', got {epsilon_high}: it is "
            "the cap on the IS weight itself, and below 1 it shrinks even on-policy tokens "
            f"(leave it unset for {CISPO_EPSILON_MAX})"
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        problems.append(
            f"importance_sampling_level must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, "
            f"got {importance_sampling_level!r}"
        )
    if not isinstance(num_iterations, int) or num_iterations < 1:
        problems.append(f"num_iterations must be an int >= 1, got {num_iterations!r}")
    return problems


class GRPOMethod(OnlineMethod):
    """Group Relative Policy Optimization; see the module docstring for the math and defaults.

    Args (besides :class:`OnlineMethod`'s):
        epsilon, epsilon_high: lower / upper clip range of the ratio (``epsilon_high=None``:
            same as ``epsilon``). With ``loss_type="cispo"``, ``epsilon_high`` is the cap on
            the IS weight itself (``>= 1``; ``None``: :data:`CISPO_EPSILON_MAX`) and
            ``epsilon`` is unused.
        num_iterations: optimizer steps per rollout batch (mu); sets ``steps_per_batch``.
        loss_type: ``"dapo"`` | ``"grpo"`` | ``"bnpo"`` | ``"dr_grpo"`` (normalisations of the
            clipped surrogate) | ``"cispo"`` (CISPO's surrogate, normalised as "dapo").
        importance_sampling_level: ``"token"`` (GRPO) | ``"sequence"`` (GSPO's sequence
            ratio).
        scale_rewards: ``"group"`` | ``"batch"`` | ``"none"``; grimoire-rl's (and older TRL's)
            booleans are read as ``True`` -> ``"group"``, ``False`` -> ``"none"``.
        dynamic_sampling: drop groups whose rewards are all equal (zero advantage; DAPO). Drop
            only: the batch is not refilled, so it shrinks; the dropped fraction is logged as
            ``dynamic_sampling/dropped_frac``.
        use_bias_correction_kl: multiply the k3 KL term by the importance ratio
            ``pi / pi_old``, with its gradient (DeepSeek-V3.2, arXiv 2512.02556, eq. 7; TRL's
            option of the same name, on by default as there since TRL 1.x). The k3 estimator's
            gradient alone is biased for ``grad KL(pi || pi_ref)`` (the samples' distribution
            depends on the parameters too); the ratio's gradient adds the missing score-function
            term ``k3 * grad log pi``, so it changes the KL gradient even on-policy, where the
            ratio's value is 1. ``False`` is the earlier behaviour (DeepSeekMath's k3 alone).

    Loss weights (so the trainer's global normalisation gives the objective of ``loss_type``):
    tokens for "dapo", sequences for "grpo" / "dr_grpo", 1 per micro-batch for "bnpo" (see
    :func:`~grimoire.losses.online_functional.reduce_token_loss`).
    """

    splits_sequences = True

    def __init__(
        self,
        reward_funcs: RewardSpec | Sequence[RewardSpec],
        *,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        num_iterations: int = 1,
        loss_type: str = "dapo",
        scale_rewards: str | bool = "group",
        dynamic_sampling: bool = False,
        use_bias_correction_kl: bool = True,
        importance_sampling_level: str = "token",
        **kwargs: Any,
    ):
        if isinstance(scale_rewards, bool):  # grimoire-rl's spelling: std-scaled or not
            scale_rewards = "group" if scale_rewards else "none"
        problems = _setting_problems(
            epsilon,
            epsilon_high,
            num_iterations,
            loss_type,
            scale_rewards,
            importance_sampling_level,
        )
        if problems:
            raise ValueError("GRPOMethod: " + "; ".join(problems))
        super().__init__(reward_funcs, **kwargs)
        if importance_sampling_level == "sequence" and loss_type in _TOKEN_SUMMING:
            logger.warning(
                "GRPOMethod: importance_sampling_level='sequence' with loss_type=%r sums "
                "per-token terms, so each sequence weighs by its length; GSPO's objective is "
                "loss_type='grpo'",
                loss_type,
            )
        if epsilon_high is None:
            epsilon_high = CISPO_EPSILON_MAX if loss_type == "cispo" else epsilon
        self.epsilon = epsilon
        self.epsilon_high = epsilon_high
        self.importance_sampling_level = importance_sampling_level
        self.num_iterations = num_iterations
        self.steps_per_batch = num_iterations
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.dynamic_sampling = dynamic_sampling
        self.use_bias_correction_kl = use_bias_correction_kl

    @property
    def ratio_to_old_logps(self) -> bool:
        return True  # the surrogate's pi / pi_old: an asynchronous sampler's log-probs are pi_old

    @property
    def needs_old_logps(self) -> bool:
        # With one update per rollout, old == current in value: use logps.detach() instead.
        return self.num_iterations > 1

    def build_batches(
        self, ctx: TrainingContext, groups: list[ScoredGroup]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        batch_std = self._batch_std(ctx, groups) if self.scale_rewards == "batch" else None
        g = self.num_generations
        out, flat_groups = [], []
        for group in groups:
            rewards = group.rewards
            advantages = group_advantages(rewards, g, self.scale_rewards, batch_std=batch_std)
            rows = list(range(rewards.numel()))
            if self.dynamic_sampling:
                flat = equal_reward_groups(rewards, g)
                rows = [i for i in rows if not bool(flat[i // g])]
                flat_groups.append(flat.float())
            batch = self.training_batch(group, rows)
            batch["advantages"] = advantages[torch.tensor(rows or [0], device=rewards.device)]
            out.append(batch)
        metrics = {}
        if flat_groups:
            metrics["dynamic_sampling/dropped_frac"] = float(torch.cat(flat_groups).mean())
        return out, metrics

    def _batch_std(self, ctx: TrainingContext, groups: list[ScoredGroup]) -> float:
        """Unbiased std of every reward of the step's real groups, all ranks (one all-reduce;
        ranks without a real group contribute nothing but still take part)."""
        r = torch.cat([g.rewards for g in groups]).double() if groups else torch.zeros(0)
        n, s1, s2 = ctx.all_reduce_sum([float(r.numel()), float(r.sum()), float((r * r).sum())])
        if n < 2:
            return 0.0
        return math.sqrt(max(0.0, (s2 - s1 * s1 / n) / (n - 1)))

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        mask = batch["completion_mask"]
        logps, entropy = self.policy_logps(model, batch)
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old
        level = self.importance_sampling_level
        per_token, info = self.surrogate(logps, old, batch["advantages"], mask)
        metrics: dict[str, Any] = {}
        weights, is_metrics = self.importance_weights(batch, old, logps, batch["advantages"])
        if weights is not None:  # a separate sampler (vLLM) or the off-policy mask, as TRL
            # The weight corrects the policy-gradient term only; the KL below is added after
            # it, unweighted, in TRL's order.
            per_token = per_token * weights
            metrics.update(is_metrics)
        if self.beta > 0:
            kl = k3_kl(logps, batch["ref_logps"])
            if self.use_bias_correction_kl:  # the ratio of the chosen level, with gradient (TRL)
                kl = kl * importance_ratio(logps, old, mask, level)
            per_token = per_token + self.beta * kl
            metrics["kl"] = masked_mean(kl, mask)
        loss = reduce_token_loss(per_token, mask, self.loss_type, self.max_new_tokens)
        low, high = info["clipped_low"], info["clipped_high"]
        # A sequence-level ratio is one value per sequence: average those over real sequences.
        where = mask if level == "token" else (mask.sum(-1, keepdim=True) > 0)
        metrics.update(
            {
                "clip_ratio/low_mean": masked_mean(low.float(), where),
                "clip_ratio/high_mean": masked_mean(high.float(), where),
                "clip_ratio/region_mean": masked_mean((low | high).float(), where),
                "ratio/mean": masked_mean(info["ratio"], where),
                "ratio/abs_dev": masked_mean((info["ratio"] - 1).abs(), where),
            }
        )
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        return loss, metrics

    def surrogate(
        self, logps: Tensor, old: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The per-token policy term ``[N, C]`` of ``loss_type`` at the chosen ratio level, and
        its detached ``ratio`` / ``clipped_low`` / ``clipped_high``."""
        level = self.importance_sampling_level
        if self.loss_type == "cispo":
            return cispo_surrogate(logps, old, advantages, self.epsilon_high, mask, level)
        return clipped_surrogate(
            logps, old, advantages, self.epsilon, self.epsilon_high, mask, level
        )

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        return reduction_units(batch["completion_mask"], self.loss_type)


__all__ = ["GRPOMethod"]
