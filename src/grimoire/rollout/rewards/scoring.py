"""Reward functions for online RL: the built-ins of the toy tasks, scoring with checks, held-out
evaluation.

A reward function is any callable called with keyword arguments only, as TRL's GRPOTrainer does,

    reward_fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float]

once per rollout batch with one entry per *completion* (a prompt sampled G times appears G
times); ``columns`` are the dataset's other fields (e.g. ``answer``), repeated the same way. How
the call is made, checked and resolved from YAML (the short names of
:data:`grimoire.config.registry.REWARD_FUNCS`, ``package.module:function`` specs, ``{type, args}``
entries) is :mod:`grimoire.rollout.rewards.calls`.
Several functions may be combined with weights; the method trains on ``sum_k w_k * r_k`` and logs
each ``r_k`` as ``rewards/<name>/mean``.

The built-ins for real tasks live beside this module: answer extraction with numeric equivalence
(:mod:`~grimoire.rollout.rewards.answers`), format and overlong shaping
(:mod:`~grimoire.rollout.rewards.shaping`) and a trained reward model
(:mod:`~grimoire.rollout.rewards.reward_model`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.columns import pad_token_id_of
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.rewards.calls import (
    RewardFn,
    RewardFunction,
    RewardSpec,
    resolve_reward_funcs,
)
from grimoire.rows.prompts import tokenize_grpo


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one number per completion."""


# --------------------------------------------------------------------------------------------
# built-in rewards for the toy reverse task (and any task with a reference ``answer`` column)
# --------------------------------------------------------------------------------------------


def exact_match_reward(
    prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any
) -> list[float]:
    """1.0 where ``completion.strip() == str(answer).strip()``, else 0.0."""
    del prompts, kwargs
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def char_match_reward(
    prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any
) -> list[float]:
    """Partial credit: matching characters at equal positions / ``max(len(c), len(a))``.

    In ``[0, 1]``; 1.0 only for an exact match (after ``strip``), and extra or missing characters
    cost credit, so it is a dense version of :func:`exact_match_reward` that a small policy can
    climb in few steps.
    """
    del prompts, kwargs
    out = []
    for c, a in zip(completions, answer):
        c, a = c.strip(), str(a).strip()
        width = max(len(c), len(a))
        out.append(sum(x == y for x, y in zip(c, a)) / width if width else 1.0)
    return out


# --------------------------------------------------------------------------------------------
# resolution and scoring
# --------------------------------------------------------------------------------------------


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
    device: torch.device | str = "cpu",
    completion_ids: Sequence[Sequence[int]] | None = None,
    metrics: dict[str, float] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run every reward function and combine them: ``total = sum_k w_k * r_k``.

    Shapes: ``prompts``, ``completions``, ``completion_ids`` (each completion's token ids; the
    ``completion_ids`` keyword is not passed when None) and every ``columns`` list have length ``N`` ->
    ``total [N]`` float32 and ``{name: r_k [N]}``. A function that raises, returns a non-sequence,
    the wrong length, or a non-finite / non-numeric entry raises :class:`RewardFunctionError`
    naming it (and the first bad entry), instead of a shape error deep in the loss. ``metrics``,
    when given, gets the counts a function returned with its rewards
    (:class:`~grimoire.rollout.rewards.calls.RewardBatch`) added as ``rewards/<name>/<key>``.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    per_func: dict[str, Tensor] = {}
    total = torch.zeros(n, dtype=torch.float32)
    for rf in reward_funcs:
        try:
            values = rf(prompts, completions, columns, completion_ids)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {rf.name!r} raised {type(exc).__name__}: {exc} "
                f"(called with {n} completions and the keywords "
                f"{sorted(rf.keywords(prompts, completions, columns, completion_ids))})"
            ) from exc
        per_func[rf.name] = _as_rewards(values, n, rf.name)
        for key, count in getattr(values, "metrics", {}).items():
            if metrics is not None:
                name = f"rewards/{rf.name}/{key}"
                metrics[name] = metrics.get(name, 0.0) + float(count)
        total += rf.weight * per_func[rf.name]
    return total.to(device), {k: v.to(device) for k, v in per_func.items()}


@torch.no_grad()
def evaluate_rewards(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_funcs: RewardSpec | Sequence[RewardSpec],
    *,
    prompt_field: str = "prompt",
    num_samples: int = 1,
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, float]:
    """Mean reward of ``model`` on raw ``rows`` (held-out prompts), per function and total.

    ``greedy=True``: one greedy completion per prompt. ``greedy=False``: ``num_samples``
    completions per prompt at ``temperature`` (the policy's *expected* reward, what online RL
    maximises), drawn from a forked RNG seeded with ``seed`` so the caller's RNG is untouched and
    two models are compared on the same random stream. Prompts are encoded like
    :func:`grimoire.rows.prompts.tokenize_grpo`; the other fields of each row are the reward
    columns. Returns ``{"reward": total mean, "<name>": mean, ...}``.
    """
    funcs = resolve_reward_funcs(reward_funcs)
    n = 1 if greedy else num_samples
    engine = HFGenerateEngine(max_new_tokens=max_new_tokens, temperature=temperature)
    pad = pad_token_id_of(tokenizer, model)
    engine.bind(model, pad, tokenizer.eos_token_id)
    sums: dict[str, float] = {}
    count = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            chunk = [
                tokenize_grpo(r, tokenizer, 10**9, prompt_field)
                for r in rows[start : start + batch_size]
            ]
            rollout = engine.generate(
                [c["prompt_input_ids"] for c in chunk], n, with_old_logps=False, greedy=greedy
            )
            ids = [
                i[m.bool()].tolist()
                for i, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
            ]
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            skip = ("prompt_input_ids", "prompt_attention_mask", "prompt")
            columns = {
                k: [c[k] for c in chunk for _ in range(n)] for k in chunk[0] if k not in skip
            }
            prompts = [c["prompt"] for c in chunk for _ in range(n)]
            total, per_func = score_completions(funcs, prompts, texts, columns, completion_ids=ids)
            for name, values in [("reward", total), *per_func.items()]:
                sums[name] = sums.get(name, 0.0) + float(values.sum())
            count += len(texts)
    return {k: v / max(count, 1) for k, v in sums.items()}


def _as_rewards(values: Any, n: int, name: str) -> Tensor:
    if isinstance(values, Tensor):
        values = values.detach().cpu().flatten().tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}; expected a list of "
            f"{n} floats (one per completion)"
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} rewards for {n} completions "
            "(it must return one float per completion)"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardFunctionError(
                f"reward function {name!r} returned {v!r} at index {i}; rewards must be finite "
                "numbers"
            )
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


__all__ = [
    "RewardFn",
    "RewardFunction",
    "RewardFunctionError",
    "char_match_reward",
    "evaluate_rewards",
    "exact_match_reward",
    "resolve_reward_funcs",
    "score_completions",
]
