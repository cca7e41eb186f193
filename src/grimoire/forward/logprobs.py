"""Per-token log-probabilities of label tokens: the one model-facing module every loss uses.

Alignment: the model's logits at position ``t`` predict token ``t + 1``. We shift labels once,
here, so every tensor returned is indexed by the *predicting* position:
``logps[b, t] = log p(labels[b, t + 1] | input_ids[b, : t + 1])``. The last position never has a
target. In padding-free (packed) rows, a position whose *next* token starts a new sample
(``position_ids[b, t + 1] == 0``) gets no target either, so the last token of one sample is never
trained to predict the first token of the next.

Two ways to get there (see ``docs/fused-logprobs.md``):

* **fused** (default): the model runs with ``logits_to_keep=1`` (so it never builds
  ``[B, T, V]`` logits), a forward hook on its decoder captures the final hidden states, and only
  the positions with a target go through the LM head, ``chunk_size`` rows at a time; each chunk
  keeps no logits for backward and recomputes them there (a checkpointing autograd Function
  specialised to a softmax head, in :mod:`grimoire.forward.fused_head`). Peak logits memory is
  ``chunk_size x V`` instead of ``B x T x V``.
* **full**: the model's own ``[B, T, V]`` logits, then log-softmax. Used with ``fused=False``,
  and as the automatic fallback for models the fused path cannot serve exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from grimoire.forward.fused_head import fused_parts, fused_token_logps

IGNORE_INDEX = -100


@dataclass
class TokenLogps:
    """Per-token log-probs of the (shifted) labels.

    Attributes:
        logps: ``[B, T]`` float32, ``log p(target_t)``; exactly 0 where ``mask`` is False.
        mask: ``[B, T]`` bool, True where position ``t`` has a trained target.
        entropy: ``[B, T]`` float32 entropy (nats) of the predictive distribution at position
            ``t``, exactly 0 where ``mask`` is False; ``None`` unless ``return_entropy=True``.
    """

    logps: Tensor
    mask: Tensor
    entropy: Tensor | None = None

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


def _logps_and_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Target log-probs and entropy of ``softmax(logits)``, both fp32.

    Shapes: ``logits [..., V]``, ``targets [...]`` -> ``([...], [...])``.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1))
    probs = torch.exp(logits - lse)
    # H = logsumexp(z) - sum_v p_v z_v: one pass over the vocab, no log(p) of tiny probabilities.
    entropy = lse.squeeze(-1) - (probs * logits).sum(-1)
    return (picked - lse).squeeze(-1), entropy


# --------------------------------------------------------------------------- post-head transforms


def _softcap(logits: Tensor, cap: float) -> Tensor:
    # Same op order as Gemma-2/3's forward (divide, tanh, multiply) so values match bit for bit.
    return torch.tanh(logits / cap) * cap


#: Transforms some architectures apply to the LM head's output inside their forward, keyed by the
#: config attribute that enables them. The fused path calls the head itself, so it must replay
#: them (in this order, in the head's output dtype, exactly as the models do).
POST_HEAD_TRANSFORMS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "final_logit_softcapping": _softcap,  # Gemma-2 / Gemma-3: tanh(z / c) * c
    "logit_scale": lambda z, s: z * s,  # Cohere / Cohere-2
    "logits_scaling": lambda z, s: z / s,  # Granite family
}


def post_head_transforms(config: Any) -> list[tuple[Callable[[Tensor, float], Tensor], float]]:
    """The declared post-head transforms of a model config, as ``(fn, value)`` pairs."""
    if config is None:
        return []
    # Multimodal wrappers (e.g. Gemma-3) keep the LM settings on the text sub-config.
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    out = []
    for attr, fn in POST_HEAD_TRANSFORMS.items():
        value = getattr(text, attr, None)
        if value is None:
            value = getattr(config, attr, None)
        if value is not None:
            out.append((fn, float(value)))
    return out


# --------------------------------------------------------------------------- public entry point


def compute_token_logps(
    model: torch.nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    *,
    fused: bool | Literal["require"] = True,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    uniform_grad: bool = False,
) -> TokenLogps:
    """Run ``model`` and return the log-probs of ``labels`` (HF convention: labels aligned with
    ``input_ids``, ``-100`` = not trained; the shift happens here).

    Shapes: ``input_ids, labels, attention_mask, position_ids: [B, T]``.

    Args:
        fused: use the memory-lean chunked LM-head path where the model supports it (it falls
            back to the full-logits path by itself otherwise; see the module docstring).
            ``"require"``: raise a ConfigError instead of falling back when the model cannot
            take the fused path (e.g. its head is sharded by ZeRO-3 / FSDP).
        chunk_size: rows pushed through the LM head at once on the fused path; peak logits
            memory is ``chunk_size x vocab``. Must be > 0 (checked on both paths).
        return_entropy: also return the per-token entropy (fp32) of the predictive distribution,
            differentiable, e.g. for online-RL metrics or an entropy bonus.
        uniform_grad: a promise that the loss is ``c * logps.sum()`` for one scalar ``c`` (a
            token-mean or token-sum NLL, as in SFT): the fused path then computes the LM head's
            gradients during the forward (one head matmul fewer, no logits recompute). Backward
            checks the promise and recomputes if it does not hold, so results are exact either
            way; a loss that mostly breaks it only loses time.

    Call it inside the caller's autocast context: the head chunks run in the same context as the
    model (and are recomputed in it during backward).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    targets = shift_labels(labels, position_ids)
    mask = targets != IGNORE_INDEX
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if fused:
        parts = fused_parts(model, require=fused == "require")
        if parts is not None:
            transforms = post_head_transforms(getattr(parts.base, "config", None))
            out = fused_token_logps(
                model,
                parts,
                transforms,
                kwargs,
                targets,
                mask,
                chunk_size,
                return_entropy,
                uniform_grad,
            )
            if out is not None:
                return TokenLogps(logps=out[0], mask=mask, entropy=out[1])
    return _full_token_logps(model, kwargs, targets, mask, return_entropy)


def _full_token_logps(
    model: torch.nn.Module,
    kwargs: dict[str, Any],
    targets: Tensor,
    mask: Tensor,
    return_entropy: bool,
) -> TokenLogps:
    """The reference path: the model's own ``[B, T, V]`` logits, log-softmax in fp32."""
    logits = model(**kwargs).logits
    safe = targets.clamp(min=0)
    if return_entropy:
        logps, entropy = _logps_and_entropy(logits, safe)
        entropy = entropy.masked_fill(~mask, 0.0)
    else:
        logps, entropy = logps_from_logits(logits, safe), None
    return TokenLogps(logps=logps.masked_fill(~mask, 0.0), mask=mask, entropy=entropy)


__all__ = [
    "IGNORE_INDEX",
    "POST_HEAD_TRANSFORMS",
    "TokenLogps",
    "compute_token_logps",
    "logps_from_logits",
    "post_head_transforms",
    "shift_labels",
]
