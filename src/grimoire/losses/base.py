"""The loss protocol: ``loss_fn(model, batch, training) -> (loss, metrics)`` plus capabilities.

The trainer only ever talks to a method through this interface; behaviour that differs between
methods (reference models, generation, how a micro-batch is weighted) lives here as properties
and hooks, never as branches in the loop. Any object with ``__call__`` and ``create_collator``
works; subclassing :class:`GrimoireLoss` just supplies sensible defaults for the optional hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import columns_of, default_budget_tokens, truncate_sequences


class GrimoireLoss:
    """Base class for training methods.

    Optional hooks the trainer calls when present (all have defaults here):

    - ``loss_weight(batch) -> float``: how many loss units (tokens, pairs, ...) the batch holds.
      The loss returned by ``__call__`` is a mean over those units; the trainer rescales each
      micro-batch by ``weight / total_weight_of_the_optimizer_step`` (summed over ranks) so that
      gradient accumulation, token-budget micro-batches and N ranks optimise the same objective as
      one big batch.
    - ``setup(ctx)``: called once before training with a
      :class:`~grimoire.config.context.TrainingContext` (config, accelerator, tokenizer, the unwrapped
      policy, datasets): place a reference model, bind a rollout engine, read options. It is the
      method's only view of the trainer.
    - ``validate_dataset(dataset, split) -> list[str]``: problems with the tokenized data, named by
      row, collected before training starts.
    - ``create_packed_collator(pad_token_id)``: the padding-free collator used when
      ``padding_free`` or ``max_tokens_per_device`` is set; None (default) = not supported.
    - ``rollouts``: a :class:`~grimoire.rollout.stage.RolloutStage` for methods that generate
      (``needs_generation``); the trainer runs it before the step's losses.
    - ``budget_tokens(lengths, packed) -> int`` and ``fit_to_budget(row, budget) -> row``: what a
      row costs in a forward pass under ``max_tokens_per_device`` and how to cut it to fit
      (:mod:`grimoire.batching.budget`); override when the method adds tokens the row does not hold
      (KTO's KL rows, online completions).
    """

    #: Columns a tokenized example must have (checked before training).
    required_columns: tuple[str, ...] = ()
    #: Needs a frozen reference policy (DPO, IPO, KTO, online methods with KL).
    needs_reference_model: bool = False
    #: Generates completions from the current policy during training (online RL).
    needs_generation: bool = False

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, float | Tensor]]:
        raise NotImplementedError

    def create_collator(self, pad_token_id: int):
        raise NotImplementedError

    def create_packed_collator(self, pad_token_id: int):
        """Padding-free collator (one packed row per micro-batch), or None when unsupported."""
        return None

    def loss_weight(self, batch: dict[str, Any]) -> float:
        """Loss units in ``batch``; default: one per row (rows equally weighted)."""
        for key, value in batch.items():
            if key.endswith("input_ids") and isinstance(value, Tensor):
                return float(value.shape[0])
        return 1.0

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """Tokens a row puts into the largest forward pass it takes part in; ``lengths`` maps
        each of its sequences (``""``, ``"chosen_"``, ...) to its ``*input_ids`` length."""
        return default_budget_tokens(lengths, packed)

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        """``row`` cut so that :meth:`budget_tokens` is within ``budget`` (opt-in truncation)."""
        return truncate_sequences(row, budget)

    def setup(self, ctx: Any) -> None:
        """Called once by the trainer before training (see the class docstring)."""

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        """Problems with ``dataset`` (missing columns); subclasses add method-specific checks."""
        names = set(columns_of(dataset))
        missing = [c for c in self.required_columns if c not in names]
        if missing:
            return [
                f"{split} dataset: missing column(s) {missing} needed by {type(self).__name__}; "
                f"it has {sorted(names)} (tokenize it with the matching grimoire.data function)"
            ]
        return []


class TokenLogpsLoss(GrimoireLoss):
    """A method whose forward passes are per-token log-probs from
    :func:`grimoire.forward.logprobs.compute_token_logps` (SFT, the pairwise losses, KTO).

    Args:
        fused, fused_chunk_size: passed to it as ``fused`` and ``chunk_size`` (the memory-lean
            chunked LM-head path, and the rows it pushes through the head at once; > 0).
    """

    def __init__(self, fused: bool = True, fused_chunk_size: int = 1024):
        if fused_chunk_size <= 0:
            raise ValueError(f"fused_chunk_size must be > 0, got {fused_chunk_size}")
        self.fused = fused
        self.fused_chunk_size = fused_chunk_size
