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

from grimoire.columns import IGNORE_INDEX
from grimoire.contract.layout import BatchLayout, shift_labels
from grimoire.forward.attention_hints import ULYSSES_ATTENTION, attention_hint, attention_impl
from grimoire.forward.fused_head import fused_parts, fused_token_logps
from grimoire.forward.head.workspace import release_workspace
from grimoire.forward.sequence_split import RowSplit, SequenceGroup, sequence_group


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


def logps_from_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[targets]`` in fp32 without materialising the full log-softmax.

    Shapes: ``logits [..., V]``, ``targets [...]`` (already valid indices) -> ``[...]`` float32.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _fp32_lse(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(logits.float(), logsumexp(logits, -1, keepdim=True))``."""
    z = logits.float()
    return z, torch.logsumexp(z, dim=-1, keepdim=True)


def _entropy_given_lse(logits: Tensor, lse: Tensor) -> Tensor:
    """``H = lse - sum_v p_v z_v`` of fp32 ``logits [..., V]`` with ``lse [..., 1]`` -> ``[...]``.

    One pass over the vocab, no ``log(p)`` of tiny probabilities. The one formula every
    full-logits entropy in grimoire uses (the fused head computes the same quantity inside its
    own fp32 pass, :func:`grimoire.forward.head.softmax._softmax_stats`).
    """
    return lse.squeeze(-1) - (torch.exp(logits - lse) * logits).sum(-1)


def token_entropy(logits: Tensor, max_elements: int = 2**26) -> Tensor:
    """Entropy (nats, fp32) of ``softmax(logits)`` at every position: ``[N, ..., V] -> [N, ...]``.

    Works in chunks of rows along the first dimension so the fp32 temporaries stay under
    ``max_elements`` (~256 MiB) whatever the logits' size. Differentiable; pass detached logits
    for a metric (no graph is then built, and each chunk's temporaries are freed as it goes).
    """
    if logits.dim() < 2:
        return _entropy_given_lse(*_fp32_lse(logits))
    n = logits.shape[0]
    if n == 0:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    rows = max(1, max_elements // max(1, logits[0].numel()))
    return torch.cat(
        [_entropy_given_lse(*_fp32_lse(logits[s : s + rows])) for s in range(0, n, rows)]
    )


def _logps_and_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Target log-probs and entropy of ``softmax(logits)``, both fp32.

    Shapes: ``logits [..., V]``, ``targets [...]`` -> ``([...], [...])``.
    """
    logits, lse = _fp32_lse(logits)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1))
    return (picked - lse).squeeze(-1), _entropy_given_lse(logits, lse)


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
    layout: BatchLayout | None = None,
    temperature: float = 1.0,
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
        layout: the rows' :class:`~grimoire.contract.layout.Packed` / ``Padded`` layout as the
            collator built it, with what it counted on the host: then the forward reads nothing
            back from the device (no host sync) to build the attention mask
            (:mod:`grimoire.forward.attention_hints`, on a model with grimoire's attention) or to
            size the LM head's rows (the layout's target count). Without it, both are read from
            the device tensors, as before.
        temperature: the log-probs of ``softmax(logits / temperature)`` (a sampling
            temperature); other than 1, the full-logits path is taken (the fused head runs at 1).

    Call it inside the caller's autocast context: the head chunks run in the same context as the
    model (and are recomputed in it during backward).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    targets = shift_labels(labels, position_ids)
    mask = targets != IGNORE_INDEX
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    hint = attention_hint(model, layout, input_ids, attention_mask, position_ids)
    if hint is not None:
        attention_mask = hint  # a 4-D marker: transformers builds (and reads) no mask
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    num_targets = None if layout is None else layout.num_targets
    if temperature != 1.0 and fused == "require":
        raise ValueError(f"fused='require' takes temperature 1 only, got {temperature}")
    head = _Head(fused if temperature == 1.0 else False, chunk_size, return_entropy, temperature)
    sp = sequence_group()
    if sp is not None:
        return _split_token_logps(sp, model, kwargs, targets, head, uniform_grad)
    return _token_logps(model, kwargs, targets, mask, head, uniform_grad, num_targets)


@dataclass(frozen=True)
class _Head:
    """How the log-probs leave the decoder: the fused head or the full logits (``fused``), its
    ``chunk_size``, with the entropy or not, at ``temperature`` (full logits only)."""

    fused: bool | Literal["require"]
    chunk_size: int
    return_entropy: bool
    temperature: float = 1.0


def _token_logps(
    model: torch.nn.Module,
    kwargs: dict[str, Any],
    targets: Tensor,
    mask: Tensor,
    head: _Head,
    uniform_grad: bool,
    num_targets: int | None,
) -> TokenLogps:
    """The forward on the model inputs ``kwargs``: the fused head where it serves, else the
    model's full logits."""
    if head.fused:
        parts = fused_parts(model, require=head.fused == "require")
        if parts is not None:
            transforms = post_head_transforms(getattr(parts.base, "config", None))
            out = fused_token_logps(
                model,
                parts,
                transforms,
                kwargs,
                targets,
                mask,
                head.chunk_size,
                head.return_entropy,
                uniform_grad,
                num_targets,
            )
            if out is not None:
                return TokenLogps(logps=out[0], mask=mask, entropy=out[1])
    return _full_token_logps(model, kwargs, targets, mask, head)


def _split_token_logps(
    sp: SequenceGroup,
    model: torch.nn.Module,
    kwargs: dict[str, Any],
    targets: Tensor,
    head: _Head,
    uniform_grad: bool,
) -> TokenLogps:
    """Sequence parallelism (:mod:`grimoire.forward.sequence_split`): this rank runs the model
    (and the head) on its slice of the packed row, targets shifted on the whole row first; the
    slices' log-probs are gathered back into the whole row on every rank of the group."""
    if attention_impl(model) != ULYSSES_ATTENTION:
        raise ValueError(
            f"training.sequence_parallel_size > 1 needs the model's attention to be "
            f"{ULYSSES_ATTENTION!r} (grimoire.model.ulysses_attention), got "
            f"{attention_impl(model)!r}: only that attention sees the other ranks' tokens"
        )
    input_ids, position_ids = kwargs["input_ids"], kwargs.get("position_ids")
    if position_ids is None or input_ids.shape[0] != 1 or kwargs.get("attention_mask") is not None:
        raise ValueError(
            "training.sequence_parallel_size > 1 splits one packed [1, L] row with its "
            "position_ids and no attention_mask; this forward got padded rows (set "
            "training.padding_free: true, or sequence_parallel_size: 1)"
        )
    split = RowSplit.of(sp, input_ids.shape[1])
    local_targets = split.local(targets, IGNORE_INDEX)
    local_kwargs = {
        **kwargs,
        "input_ids": split.local(input_ids, 0),
        "position_ids": split.local_positions(position_ids),
    }
    local_mask = local_targets != IGNORE_INDEX
    out = _token_logps(model, local_kwargs, local_targets, local_mask, head, uniform_grad, None)
    entropy = None if out.entropy is None else split.gather(out.entropy)
    return TokenLogps(split.gather(out.logps), targets != IGNORE_INDEX, entropy)


def _full_token_logps(
    model: torch.nn.Module, kwargs: dict[str, Any], targets: Tensor, mask: Tensor, head: _Head
) -> TokenLogps:
    """The reference path: the model's own ``[B, T, V]`` logits (over the temperature),
    log-softmax in fp32."""
    logits = model(**kwargs).logits
    if head.temperature != 1.0:
        logits = logits / head.temperature
    safe = targets.clamp(min=0)
    if head.return_entropy:
        logps, entropy = _logps_and_entropy(logits, safe)
        entropy = entropy.masked_fill(~mask, 0.0)
    else:
        logps, entropy = logps_from_logits(logits, safe), None
    return TokenLogps(logps=logps.masked_fill(~mask, 0.0), mask=mask, entropy=entropy)


def release_buffers() -> None:
    """Free this thread's reusable CPU buffers of the fused LM head (its logits, fp32 blocks and
    cast weight). They are kept between calls on purpose (a fresh buffer page-faults on every
    call); call this when no more log-probs will be computed for a while, e.g. after training.
    The next call allocates them again."""
    release_workspace()


__all__ = [
    "IGNORE_INDEX",
    "POST_HEAD_TRANSFORMS",
    "TokenLogps",
    "compute_token_logps",
    "logps_from_logits",
    "post_head_transforms",
    "release_buffers",
    "shift_labels",
    "token_entropy",
]
