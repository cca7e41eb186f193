"""Per-token log-probabilities of label tokens: the one model-facing module every loss uses.

Alignment: the model's logits at position ``t`` predict token ``t + 1``. We shift labels once,
here, so every tensor returned is indexed by the *predicting* position:
``logps[b, t] = log p(labels[b, t + 1] | input_ids[b, : t + 1])``. The last position never has a
target. In padding-free (packed) rows, a position whose *next* token starts a new sample
(``position_ids[b, t + 1] == 0``) gets no target either, so the last token of one sample is never
trained to predict the first token of the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass
class TokenLogps:
    """Per-token log-probs of the (shifted) labels.

    Attributes:
        logps: ``[B, T]`` float32, ``log p(target_t)``; exactly 0 where ``mask`` is False.
        mask: ``[B, T]`` bool, True where position ``t`` has a trained target.
    """

    logps: Tensor
    mask: Tensor

    def sum(self) -> Tensor:
        """Summed log-prob of each row's targets, ``[B]``."""
        return self.logps.sum(-1)

    def count(self) -> Tensor:
        """Number of targets in each row, ``[B]`` (float)."""
        return self.mask.sum(-1).to(self.logps.dtype)

    def mean(self) -> Tensor:
        """Length-averaged log-prob of each row, ``[B]``; 0 for rows with no targets."""
        return self.sum() / self.count().clamp(min=1.0)


def shift_labels(labels: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """Targets per predicting position: ``out[:, t] = labels[:, t + 1]``, last column ignored.

    With ``position_ids`` (packed rows), a target that is the first token of a sample
    (``position_ids == 0``) is ignored: it would be predicted from another sample's context.
    """
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        starts = torch.zeros_like(out, dtype=torch.bool)
        starts[:, :-1] = position_ids[:, 1:] == 0
        out = out.masked_fill(starts, IGNORE_INDEX)
    return out


def logps_from_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[targets]`` in fp32 without materialising the full log-softmax.

    Shapes: ``logits [..., V]``, ``targets [...]`` (already valid indices) -> ``[...]`` float32.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def compute_token_logps(
    model: torch.nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    *,
    fused: bool = True,
    chunk_size: int = 1024,
) -> TokenLogps:
    """Run ``model`` and return the log-probs of ``labels`` (HF convention: labels aligned with
    ``input_ids``, ``-100`` = not trained; the shift happens here).

    Shapes: ``input_ids, labels, attention_mask, position_ids: [B, T]``.
    ``fused`` selects the memory-lean chunked LM-head path where the model supports it.
    """
    del fused, chunk_size  # the fused path plugs in here (see the fused log-probs module)
    kwargs: dict[str, Tensor | bool] = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    logits = model(**kwargs).logits
    targets = shift_labels(labels, position_ids)
    mask = targets != IGNORE_INDEX
    logps = logps_from_logits(logits, targets.clamp(min=0))
    return TokenLogps(logps=logps.masked_fill(~mask, 0.0), mask=mask)
