"""An engine's sampler settings: one typed config, checked once.

Stage: rollout (see docs/architecture.md). :class:`SamplerConfig` is what a
:class:`~grimoire.rollout.engines.base.RolloutEngine` samples with (its ``sampler``); the online
methods' ``sampling`` (:class:`~grimoire.rollout.stage.SamplingConfig`) is the engine's settings
plus ``num_generations``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """How an engine samples: every setting an engine reads, checked once, when it is built.

    Attributes:
        max_new_tokens: longest completion (an int > 0).
        temperature: the logits are divided by it (> 0: online RL needs diverse samples).
        top_p: nucleus filter, in ``(0, 1]`` (1.0 = off).
        top_k: keep the ``k`` likeliest tokens, an int >= 0 (0 = off).
        generation_batch_size: at most this many sequences per sampling call and per scoring
            forward (memory, never the results); ``None``: no cap.
        seed: base of the per-request seeds of an engine that seeds its own requests (vLLM);
            ``None``: torch's initial seed when the engine is bound (the run's). The HF engine
            draws from torch's generator and takes none.
        importance_sampling_cap: ``C`` of the truncated importance weight
            ``min(pi_old / pi_sampler, C)`` (>= 1) the policy-gradient losses apply when
            rollouts carry ``sampler_logps``; ``None``: the engine samples from the training
            model itself, so there is no mismatch to correct.

    Keyword arguments only. A bad value is a ``ValueError`` listing every problem (a changed
    copy, made with ``dataclasses.replace``, is checked again).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    generation_batch_size: int | None = None
    seed: int | None = None
    importance_sampling_cap: float | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("sampler settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when nothing)."""
        out = []
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            out.append(f"max_new_tokens must be an int > 0, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            out.append(
                f"temperature must be > 0 (online RL needs diverse samples), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            out.append(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        gbs = self.generation_batch_size
        if gbs is not None and (not _is_int(gbs) or gbs <= 0):
            out.append(f"generation_batch_size must be an int > 0, got {gbs!r}")
        if self.seed is not None and not _is_int(self.seed):
            out.append(f"seed must be an int, got {self.seed!r}")
        cap = self.importance_sampling_cap
        if cap is not None and not cap >= 1.0:
            out.append(f"importance_sampling_cap must be >= 1, got {cap}")
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["SamplerConfig"]
