"""What an online method checks before it trains: its constructor's settings, and at set-up
that every prompt leaves room for its completion and that sampling and training agree.

Plain functions of the values they check, so :class:`grimoire.losses.online.OnlineMethod`
keeps only the rollout flow; each raises (or warns) in the user's terms, naming the method.
"""

from __future__ import annotations

import logging

import torch

from grimoire.columns import column_values, listed
from grimoire.config.context import TrainingContext
from grimoire.errors import DataError

logger = logging.getLogger(__name__)


def check_online_settings(
    name: str, num_generations: int, min_generations: int, beta: float, fused_chunk_size: int
) -> None:
    """A ValueError, at construction, for a setting no step could train with."""
    if not isinstance(num_generations, int) or num_generations < min_generations:
        raise ValueError(
            f"{name}: num_generations must be an int >= {min_generations} (the method "
            f"compares completions within a group), got {num_generations!r}"
        )
    if beta < 0:
        raise ValueError(f"{name}: beta must be >= 0, got {beta}")
    if fused_chunk_size <= 0:
        raise ValueError(f"{name}: fused_chunk_size must be > 0, got {fused_chunk_size}")


def check_prompt_lengths(ctx: TrainingContext, max_new_tokens: int) -> None:
    """A DataError listing every train / eval prompt that leaves no room for ``max_new_tokens``
    within ``training.max_length`` or the model's positions, whichever is smaller."""
    limit, where = ctx.config.max_length, "training.max_length"
    max_pos = getattr(getattr(ctx.unwrapped_model, "config", None), "max_position_embeddings", 0)
    if isinstance(max_pos, int) and 0 < max_pos < limit:
        limit, where = max_pos, "the model's max_position_embeddings"
    problems = []
    for split, ds in (("train", ctx.train_dataset), ("eval", ctx.eval_dataset)):
        if ds is None:
            continue
        for i, row in enumerate(column_values(ds, "prompt_input_ids")):
            if len(row) + max_new_tokens > limit:
                problems.append(
                    f"{split} row {i}: prompt of {len(row)} tokens + max_new_tokens="
                    f"{max_new_tokens} > {limit} ({where}); shorten the prompt, lower "
                    "max_new_tokens or raise the limit"
                )
    if problems:
        raise DataError(
            listed(problems), title="prompts do not fit the context (nothing was trained)"
        )


def warn_on_dropout(name: str, ctx: TrainingContext) -> None:
    """Warn when the policy keeps dropout: sampling and training would then see different
    models, so their log-probs (and every ratio built on them) disagree."""
    policy = ctx.unwrapped_model
    dropout = [m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout and not ctx.config.disable_dropout:
        logger.warning(
            "%s: the model has dropout (p=%s); set training.disable_dropout=True so the "
            "log-probs of sampling and training agree",
            name,
            dropout[0],
        )


__all__ = ["check_online_settings", "check_prompt_lengths", "warn_on_dropout"]
