"""NEFTune: uniform noise on the input embeddings of training forwards.

Jain et al., "NEFTune: Noisy Embeddings Improve Instruction Finetuning", arXiv 2310.05914.
Each embedding vector gets ``Uniform(-1, 1) * alpha / sqrt(L * d)`` added (``d``: hidden size,
``L``: sequence length), so the expected norm of a sequence's noise is ``alpha / sqrt(3)``
whatever its length.

**Which L.** The paper's ``L`` is the length of the sequence. TRL (and transformers' Trainer)
use the batch tensor's dim 1, i.e. the *padded* width, and for a padding-free packed row the
length of the whole pack, so a sample's noise depends on what it is batched or packed with. We use
each token's own sample length: the real tokens of its row (``attention_mask.sum(1)``) for padded
batches, the length of its segment (``position_ids`` restarting at 0) for packed rows. A sample
therefore gets the same noise distribution padded or packed, as every other quantity in Grimoire
does; for unpadded batches this is exactly TRL's value. Only when the forward gets neither (a
bare ``embed(input_ids)`` call) the tensor's dim 1 is used.

**When.** Only in forwards that train: module in training mode AND autograd enabled. So never in
eval mode (evaluation, ``generate``, which rollouts run under eval mode), and never in no-grad
forwards made in training mode (reference log-probs from the LoRA base, rollout old log-probs),
which must score the clean policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grimoire.model.blocks import peft_base

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def token_lengths(
    shape: tuple[int, int],
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """``[B, T]`` float: for every position, the length of the sample it belongs to."""
    batch, width = shape
    if position_ids is not None and position_ids.shape == (batch, width):
        starts = (position_ids == 0).long()
        starts[:, 0] = 1  # a row always opens a segment
        seg = starts.cumsum(1) - 1  # segment index within the row
        counts = torch.zeros(batch, width, dtype=torch.long, device=seg.device)
        counts.scatter_add_(1, seg, torch.ones_like(seg))
        return counts.gather(1, seg).float()
    if attention_mask is not None and attention_mask.shape == (batch, width):
        real = attention_mask.sum(1, keepdim=True).clamp(min=1).float()
        return real.expand(batch, width)
    return torch.full((batch, width), float(width))


class NEFTune:
    """The hooks of one model: a pre-hook on the CausalLM records the batch layout, a forward
    hook on its input embeddings adds the noise. ``remove()`` takes both off."""

    def __init__(self, model: PreTrainedModel, alpha: float):
        if alpha <= 0:
            raise ValueError(f"neftune_noise_alpha must be > 0, got {alpha}")
        embed = model.get_input_embeddings()
        if not isinstance(embed, torch.nn.Module):
            raise ValueError(f"{type(model).__name__} has no input embeddings for NEFTune")
        self.alpha = alpha
        self._layout: dict[str, Tensor | None] = {}
        self._handles = [
            model.register_forward_pre_hook(self._record, with_kwargs=True),
            embed.register_forward_hook(self._add_noise),
        ]

    def _record(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._layout = {
            "attention_mask": kwargs.get("attention_mask"),
            "position_ids": kwargs.get("position_ids"),
        }

    def _add_noise(self, module: torch.nn.Module, _args: Any, output: Tensor) -> Tensor | None:
        layout, self._layout = self._layout, {}  # one model forward, one embedding call
        if not (module.training and torch.is_grad_enabled()) or output.dim() != 3:
            return None
        batch, width, dim = output.shape
        lengths = token_lengths((batch, width), **layout).to(output.device)
        scale = (self.alpha / torch.sqrt(lengths * dim)).unsqueeze(-1).to(output.dtype)
        noise = torch.empty_like(output).uniform_(-1.0, 1.0)
        return output + noise * scale

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attach_neftune(model: torch.nn.Module, alpha: float) -> NEFTune:
    """Install NEFTune on ``model`` (a CausalLM, or a PEFT model: its base gets the hooks)."""
    base = peft_base(model)
    return NEFTune(base, alpha)


__all__ = ["NEFTune", "attach_neftune", "token_lengths"]
