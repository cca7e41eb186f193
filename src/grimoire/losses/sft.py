"""Supervised fine-tuning: token-mean negative log-likelihood on the unmasked labels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grimoire.collate.packing import PackedCollator
from grimoire.collate.sft import SFTCollator
from grimoire.contract.layout import attention_inputs, layout_of, num_targets
from grimoire.forward.logprobs import compute_token_logps
from grimoire.losses.base import TokenLogpsLoss


class SFTLoss(TokenLogpsLoss):
    """``loss = -sum_t log p(y_t) / N_tokens`` over the micro-batch's trained tokens.

    Under gradient accumulation / several ranks the trainer weights each micro-batch by its
    token count (``loss_weight``), so the optimizer step sees the mean over *all* tokens of the
    global batch, exactly as one big batch would.
    """

    required_columns = ("input_ids", "labels")

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor | float]]:
        attention_mask, position_ids = attention_inputs(batch)
        out = compute_token_logps(
            model,
            batch["input_ids"],
            batch["labels"],
            attention_mask=attention_mask,
            position_ids=position_ids,
            fused=self.fused,
            chunk_size=self.fused_chunk_size,
            uniform_grad=True,  # -sum(logps) / N: one upstream grad for every token
            layout=layout_of(batch),  # the collator's host-side counts: no device reads
        )
        n_tokens = out.mask.sum()
        loss = -out.logps.sum() / n_tokens.clamp(min=1)
        return loss, {"nll": loss.detach(), "num_loss_tokens": n_tokens.detach().float()}

    def loss_weight(self, batch: dict[str, Any]) -> float:
        # The collator's host-side count, else counted from the labels by the shifted-target rule.
        return float(num_targets(batch))

    def create_collator(self, pad_token_id: int) -> SFTCollator:
        return SFTCollator(pad_token_id=pad_token_id)

    def create_packed_collator(self, pad_token_id: int) -> PackedCollator:
        return PackedCollator(pad_token_id)
