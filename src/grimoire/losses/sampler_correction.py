"""How an online method corrects for a sampler that is not the learner (``loss.args``).

The settings under TRL 1.16's ``GRPOConfig`` names, checked once; the math is in
:mod:`grimoire.losses.sampler_functional` (:func:`~grimoire.losses.sampler_functional.
importance_sampling_weights`, :func:`~grimoire.losses.sampler_functional.off_policy_sequence_mask`).
TRL's ``vllm_``-prefixed spellings are accepted as aliases of the same settings (TRL only has a
sampler other than the learner with vLLM; here an asynchronous sampler is one too).

How they meet the engine's own ``importance_sampling`` / ``importance_sampling_cap`` (the vLLM
engines): the engine decides whether there is anything to correct (with
``importance_sampling: false`` it returns no sampler log-probs, so no weight and no
diagnostics); the loss decides how. ``importance_sampling_clip_max`` left unset is the engine's
cap (2.0 by default), so ``token_truncate`` with nothing set is the engine's truncation as
before; set here, it wins over the engine's.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grimoire.losses.online_functional import masked_mean
from grimoire.losses.sampler_functional import (
    check_importance_sampling,
    importance_sampling_weights,
    off_policy_sequence_mask,
    sampler_mismatch_metrics,
)

#: TRL's ``vllm_``-prefixed spelling -> the setting it is another name of.
ALIASES = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "importance_sampling_clip_min",
}
#: The upper bound when neither the loss nor the engine gives one (an asynchronous HF
#: sampler's engine has no cap): the vLLM engines' default cap.
DEFAULT_CLIP_MAX = 2.0


@dataclass(frozen=True, kw_only=True)
class SamplerCorrection:
    """The sampler/learner mismatch correction of an online method.

    Args:
        importance_sampling_correction: weight the policy-gradient term by the importance ratio
            ``pi_old / pi_sampler`` where rollouts come from a sampler that is not the learner
            (``false``: no weight; the mismatch diagnostics are still logged).
        importance_sampling_mode: ``token_truncate`` (default) | ``token_mask`` |
            ``sequence_truncate`` | ``sequence_mask``: the ratio per token or per completion,
            clipped to the bounds or zeroed outside them.
        importance_sampling_clip_max, importance_sampling_clip_min: the bounds (``None``: the
            engine's ``importance_sampling_cap`` above, none below).
        off_policy_mask_threshold: DeepSeek-V3.2's ``delta`` (nats per token): drop a
            completion with a negative advantage whose mean ``KL(sampler || policy)`` exceeds
            it (``None``: off). Methods with a per-completion advantage (GRPO, RLOO).
        vllm_*: TRL's names of the four settings above (give one name of each, not both).
    """

    importance_sampling_correction: bool = True
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_clip_max: float | None = None
    importance_sampling_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    vllm_importance_sampling_correction: bool | None = None
    vllm_importance_sampling_mode: str | None = None
    vllm_importance_sampling_clip_max: float | None = None
    vllm_importance_sampling_clip_min: float | None = None

    @classmethod
    def take(cls, owner: str, given: MutableMapping[str, Any]) -> SamplerCorrection:
        """The settings among ``given``'s keys, removed from it, aliases resolved and checked:
        a ValueError naming ``owner`` lists every problem."""
        names = [f.name for f in dataclasses.fields(cls)]
        mine = {k: given.pop(k) for k in names if k in given}
        problems = []
        for alias, name in ALIASES.items():
            if mine.get(alias) is None:
                mine.pop(alias, None)
            elif name in mine:
                problems.append(f"give {name} or its alias {alias}, not both")
            else:
                mine[name] = mine.pop(alias)
        out = cls(**mine)
        problems += check_importance_sampling(
            out.importance_sampling_mode,
            out.clip_max(DEFAULT_CLIP_MAX),
            out.importance_sampling_clip_min,
            out.off_policy_mask_threshold,
        )
        if not isinstance(out.importance_sampling_correction, bool):
            problems.append(
                "importance_sampling_correction must be true or false, got "
                f"{out.importance_sampling_correction!r}"
            )
        if problems:
            raise ValueError(f"{owner}: " + "; ".join(problems))
        return out

    def clip_max(self, engine_cap: float | None) -> float | None:
        """The upper bound: this setting's, else the engine's cap, else :data:`DEFAULT_CLIP_MAX`."""
        if self.importance_sampling_clip_max is not None:
            return self.importance_sampling_clip_max
        return DEFAULT_CLIP_MAX if engine_cap is None else engine_cap

    def weights(
        self,
        mask: Tensor,
        old_logps: Tensor,
        sampler_logps: Tensor | None,
        *,
        sampler_differs: bool,
        engine_cap: float | None,
        logps: Tensor | None = None,
        advantages: Tensor | None = None,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Detached weights ``[N, C]`` of each token's policy-gradient term and their metrics;
        ``(None, {})`` when nothing is corrected (the HF engine, synchronous: the loss is then
        bit-identical to an uncorrected one).

        Two corrections multiply: where ``sampler_differs`` (a setting of the run), the
        importance weight of the mode, ``old_logps`` against ``sampler_logps``
        (:func:`~grimoire.losses.sampler_functional.importance_sampling_weights`); and, given
        ``off_policy_mask_threshold``, the current policy's ``logps`` and the per-completion
        ``advantages [N]``, DeepSeek-V3.2's off-policy sequence mask, taken against the sampler's
        log-probs or else ``old_logps`` (as TRL), so it also drops completions
        ``num_iterations > 1`` has left behind. A placeholder batch has no sampler log-probs: it
        is weighted against ``old_logps`` itself (weight 1), and its metrics still register
        (with weight 0), so every rank logs the same keys."""
        weights, metrics = None, {}
        if sampler_differs:
            theirs = old_logps.detach() if sampler_logps is None else sampler_logps
            mode, lo = self.importance_sampling_mode, self.importance_sampling_clip_min
            hi = self.clip_max(engine_cap)
            computed = importance_sampling_weights(old_logps, theirs, mask, mode, hi, lo)
            metrics = sampler_mismatch_metrics(old_logps, theirs, mask, mode, hi, lo, computed)
            if self.importance_sampling_correction:
                weights = computed
            else:  # no weight: only what measures the mismatch itself
                metrics = {k: v for k, v in metrics.items() if "importance" not in k}
        t = self.off_policy_mask_threshold
        if t is not None and logps is not None and advantages is not None:
            behaviour = old_logps if sampler_logps is None else sampler_logps
            keep = off_policy_sequence_mask(advantages, logps, behaviour, mask, t)
            real = mask.sum(-1, keepdim=True) > 0
            metrics["sampling/off_policy_masked_frac"] = masked_mean(1.0 - keep, real)
            weights = keep.expand(mask.shape) if weights is None else weights * keep
        return weights, metrics


#: Every setting's name (aliases included): what a method without a policy gradient hides.
CORRECTION_ARGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplerCorrection))


def correction_parameters() -> list[inspect.Parameter]:
    """The settings as keyword-only parameters, for the online methods' spelled-out signature."""
    return [
        p.replace(kind=p.KEYWORD_ONLY)
        for p in inspect.signature(SamplerCorrection).parameters.values()
    ]


__all__ = [
    "ALIASES",
    "CORRECTION_ARGS",
    "DEFAULT_CLIP_MAX",
    "SamplerCorrection",
    "correction_parameters",
]
