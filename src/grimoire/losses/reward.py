"""Reward modelling: ``RewardModelLoss``, Bradley-Terry on a sequence-classification model.

Bradley-Terry pairwise loss as used for RLHF reward models (Ouyang et al., arXiv 2203.02155),
with Llama 2's optional margin (Touvron et al., arXiv 2307.09288). Math:
:func:`grimoire.losses.functional.bradley_terry_loss`.

The model is an ``AutoModelForSequenceClassification`` with ``num_labels=1``. Its reward for a
sequence is the score at the LAST NON-PAD token, which is exactly what transformers' own pooling
returns at inference (the rightmost token that is not ``config.pad_token_id``). The loss checks,
every batch, that this pooled position is the last attended token, so training and inference
read the reward at the same place; it fails loudly when they would differ (typically
``pad_token_id == eos_token_id`` with EOS appended to every response).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.collate.preference import PreferenceCollator
from grimoire.config.context import TrainingContext
from grimoire.errors import ConfigError
from grimoire.losses.base import GrimoireLoss
from grimoire.losses.functional import bradley_terry_loss
from grimoire.losses.preference import pair_rows, scalar_metrics, unwrap

RM_COLUMNS: tuple[str, ...] = (
    "chosen_input_ids",
    "chosen_attention_mask",
    "rejected_input_ids",
    "rejected_attention_mask",
)


def _config(model: torch.nn.Module) -> Any:
    return getattr(unwrap(model), "config", None)


class RewardModelLoss(GrimoireLoss):
    """``loss = mean_B -log sigma(r(x, y_w) - r(x, y_l) - m)``.

    Args:
        margin_field: name of a numeric batch column holding the per-pair margin ``m`` (e.g.
            written by ``tokenize_preference(..., margin_field="margin")``); None for no margin.
        margin: one constant ``m`` for every pair (grimoire-rl's argument); 0 = none.

    Chosen and rejected go through the model in one concatenated forward. Metrics (scalar
    means): ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (``r_w - r_l``,
    without ``m``), ``rewards/accuracies``, and TRL's aliases ``accuracy`` / ``margin``. There
    are no log-probs to log. ``loss_weight`` =
    pairs.
    """

    #: The CLI loads ``AutoModelForSequenceClassification(num_labels=1)`` for this method.
    model_kind = "sequence_classification"

    def __init__(self, margin_field: str | None = None, margin: float = 0.0):
        if margin_field is not None and margin:
            raise ValueError(
                "give margin_field (a per-pair column) or margin (a constant), not both"
            )
        self.margin_field, self.margin = margin_field, float(margin)
        self.required_columns = RM_COLUMNS + ((margin_field,) if margin_field else ())

    def create_collator(self, pad_token_id: int) -> PreferenceCollator:
        return PreferenceCollator(pad_token_id=pad_token_id)

    def loss_weight(self, batch: dict[str, Any]) -> float:
        return float(batch["chosen_input_ids"].shape[0])

    def setup(self, ctx: TrainingContext) -> None:
        config = _config(ctx.unwrapped_model)
        pad = getattr(config, "pad_token_id", None)
        num_labels = getattr(config, "num_labels", None)
        problems = []
        if num_labels != 1:
            problems.append(
                f"RewardModelLoss needs a scalar reward head: load the model with "
                f"AutoModelForSequenceClassification.from_pretrained(..., num_labels=1) "
                f"(it has num_labels={num_labels})"
            )
        tok_pad = getattr(ctx.tokenizer, "pad_token_id", None)
        if pad is None:
            problems.append(
                "RewardModelLoss: model.config.pad_token_id is None, so transformers cannot find "
                "the last real token of padded rows; set model.config.pad_token_id = "
                "tokenizer.pad_token_id"
            )
        elif tok_pad is not None and tok_pad != pad:
            problems.append(
                f"RewardModelLoss: the tokenizer pads with id {tok_pad} but model.config."
                f"pad_token_id is {pad}; they must agree for the reward to be read at the last "
                "real token"
            )
        if problems:
            raise ConfigError(problems)

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        pad = getattr(_config(model), "pad_token_id", None)
        ids, mask, _ = pair_rows(batch, pad_value=pad if pad is not None else 0)
        logits = model(input_ids=ids, attention_mask=mask).logits
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise ValueError(
                "RewardModelLoss needs one score per sequence (num_labels=1); the model returned "
                f"logits of shape {tuple(logits.shape)}"
            )
        self._check_pooling(ids, mask, pad)
        rewards = logits[:, 0]
        n = batch["chosen_input_ids"].shape[0]
        margin = self.margin or None
        if self.margin_field is not None:
            margin = torch.as_tensor(batch[self.margin_field], device=rewards.device).float()
        losses, metrics = bradley_terry_loss(rewards[:n], rewards[n:], margin)
        out = scalar_metrics(metrics)
        # Aliases under TRL RewardTrainer's names, so its dashboards and sweeps read ours.
        out["accuracy"] = out["rewards/accuracies"]
        out["margin"] = out["rewards/margins"]
        return losses.mean(), out

    @staticmethod
    def _check_pooling(ids: Tensor, mask: Tensor, pad: int | None) -> None:
        """Fail when transformers' pooled position is not the last attended token."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        last_real = (positions * mask.long()).argmax(-1)
        if pad is None:
            pooled = torch.full_like(last_real, ids.shape[1] - 1)
        else:
            pooled = (positions * (ids != pad).long()).argmax(-1)
        bad = (pooled != last_real).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"RewardModelLoss: for rows {bad[:5]} of the stacked [chosen; rejected] batch, "
                "transformers reads the reward at a different position than the last real "
                f"token (pad_token_id={pad} also occurs as the last real token, e.g. when "
                "pad == eos). Give the tokenizer a distinct pad token (add one and resize the "
                "embeddings), and set model.config.pad_token_id to it."
            )


__all__ = ["RM_COLUMNS", "RewardModelLoss"]
