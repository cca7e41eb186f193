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
  keeps no logits for backward and recomputes them there (:class:`_HeadChunkLogps`, a
  checkpointing autograd Function specialised to a softmax head). Peak logits memory is
  ``chunk_size x V`` instead of ``B x T x V``.
* **full**: the model's own ``[B, T, V]`` logits, then log-softmax. Used with ``fused=False``,
  and as the automatic fallback for models the fused path cannot serve exactly.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

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
    fused: bool = True,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> TokenLogps:
    """Run ``model`` and return the log-probs of ``labels`` (HF convention: labels aligned with
    ``input_ids``, ``-100`` = not trained; the shift happens here).

    Shapes: ``input_ids, labels, attention_mask, position_ids: [B, T]``.

    Args:
        fused: use the memory-lean chunked LM-head path where the model supports it (it falls
            back to the full-logits path by itself otherwise; see the module docstring).
        chunk_size: rows pushed through the LM head at once on the fused path; peak logits
            memory is ``chunk_size x vocab``. Must be > 0 (checked on both paths).
        return_entropy: also return the per-token entropy (fp32) of the predictive distribution,
            differentiable, e.g. for online-RL metrics or an entropy bonus.

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
        parts = _fused_parts(model)
        if parts is not None:
            out = _fused_token_logps(
                model, parts, kwargs, targets, mask, chunk_size, return_entropy
            )
            if out is not None:
                return out
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


# --------------------------------------------------------------------------- fused path


@dataclass
class _FusedState:
    """What we learned about one model: set once, kept for the model's lifetime."""

    checked: bool = False  # the self-check passed
    disabled: str | None = None  # why the fused path is off for good (None: it is on)


# The self-check verdict, keyed by the unwrapped CausalLM so DDP / PEFT wrappers of one model
# share it; weak so a deleted model takes its entry with it.
_STATE: weakref.WeakKeyDictionary[torch.nn.Module, _FusedState] = weakref.WeakKeyDictionary()
# Structural support (head present, not sharded, decoder reachable), keyed by the object passed
# in: the same model may be fine bare and unsupported once wrapped (FSDP, ZeRO-3).
_SUPPORT: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


@dataclass
class _Parts:
    base: torch.nn.Module  # the CausalLM (under any DDP / PEFT wrappers)
    decoder: torch.nn.Module  # whose output (last_hidden_state) feeds the head
    head: torch.nn.Module  # get_output_embeddings(): nn.Linear, LoRA-wrapped Linear, ...
    state: _FusedState


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The CausalLM inside DDP / DataParallel / DeepSpeed / torch.compile / PEFT wrappers."""
    for _ in range(8):  # wrappers nest a few levels at most; never loop forever
        if isinstance(
            model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel
        ) or type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine"):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        elif type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
            if inner is model:
                break
            model = inner
        else:
            break
    return model


def _is_sharded(param: Tensor) -> bool:
    """FSDP2 DTensor, a DeepSpeed ZeRO-3 partitioned param, or an FSDP1 flat-param stub."""
    if hasattr(param, "ds_numel") or hasattr(param, "ds_id"):
        return True
    if param.numel() == 0:
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return False
    return isinstance(param, DTensor)


def _unsupported_reason(model: torch.nn.Module, base: torch.nn.Module) -> str | None:
    """Why the fused path cannot serve ``model`` (``None``: it can)."""
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module):
        return "the model has no output embeddings (get_output_embeddings() is None)"
    if any(_is_sharded(p) for p in head.parameters()):
        return "the LM head's weight is sharded (FSDP / DeepSpeed ZeRO-3)"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        FullyShardedDataParallel = ()
    if FullyShardedDataParallel and any(
        isinstance(m, FullyShardedDataParallel) for m in model.modules()
    ):
        return "the model is wrapped in FSDP (the head can't be called outside its forward)"
    get_decoder = getattr(base, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # some exotic models raise instead of returning nothing
        decoder = None
    if not isinstance(decoder, torch.nn.Module) or decoder is base:
        return "the model is not a CausalLM with a reachable decoder (get_decoder())"
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "logits_to_keep" not in params:
        return "the model's forward does not accept logits_to_keep"
    return None


def _fused_parts(model: torch.nn.Module) -> _Parts | None:
    """Decoder and head for the fused path, or ``None`` to use the full path (logged once)."""
    base = _unwrap(model)
    if model not in _SUPPORT:
        reason = _SUPPORT[model] = _unsupported_reason(model, base)
        if reason is not None:
            logger.info(
                "fused log-probs off for %s: %s; using full logits", type(base).__name__, reason
            )
    if _SUPPORT[model] is not None:
        return None
    state = _STATE.setdefault(base, _FusedState())
    if state.disabled is not None:
        return None
    return _Parts(
        base=base, decoder=base.get_decoder(), head=base.get_output_embeddings(), state=state
    )


def _disable(state: _FusedState, base: torch.nn.Module, reason: str) -> None:
    state.disabled = reason
    logger.info("fused log-probs off for %s: %s; using full logits", type(base).__name__, reason)


def _head_logits(head: torch.nn.Module, transforms: list, hidden: Tensor) -> Tensor:
    """``transforms(head(hidden))`` in the head's output dtype: ``[N, H] -> [N, V]``."""
    logits = head(hidden)
    for fn, value in transforms:
        logits = fn(logits, value)
    return logits


#: fp32 work on ``[rows, V]`` logits is done this many elements at a time (128 MiB temporaries),
#: so a chunk's fp32 copies never add up to ``chunk_size x V x 4`` bytes, while the head matmul
#: still runs on the whole chunk (big matmuls are what's efficient).
_FP32_BLOCK_ELEMS = 1 << 25


def _row_blocks(rows: int, vocab: int) -> list[slice]:
    step = max(1, _FP32_BLOCK_ELEMS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


@torch.no_grad()
def _softmax_stats(
    logits: Tensor, targets: Tensor, want_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Target log-probs, log-sum-exp and (optionally) entropy of each row, all fp32 ``[N]``.

    ``logits [N, V]`` (any float dtype; may be overwritten), ``targets [N]``. The log-sum-exp is
    written out (``m + log(sum(exp(z - m)))``) so the fp32 block is reused in place.
    """
    n = logits.shape[0]
    logps = logits.new_empty(n, dtype=torch.float32)
    lse = torch.empty_like(logps)
    entropy = torch.empty_like(logps) if want_entropy else None
    for rows in _row_blocks(n, logits.shape[-1]):
        z = logits[rows].float()
        m = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)  # all -inf row: no NaN
        picked = z.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
        if entropy is not None:
            e = (z - m).exp_()
            total = e.sum(-1)
            # H = lse - sum_v p_v z_v = lse - sum_v e_v z_v / sum_v e_v.
            weighted = e.mul_(z).sum(-1)
            block_lse = m.squeeze(-1) + total.log()
            entropy[rows] = block_lse - weighted / total
        else:
            block_lse = m.squeeze(-1) + z.sub_(m).exp_().sum(-1).log()
        lse[rows] = block_lse
        logps[rows] = picked - block_lse
    return logps, lse, entropy


@torch.no_grad()
def _grad_logits(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logps: Tensor,
    grad_entropy: Tensor | None,
) -> Tensor:
    """``dL/dlogits`` in ``logits``' dtype from the incoming grads of logps / entropy.

    Shapes: ``logits [N, V]`` (read only), the rest ``[N]``. With ``p = softmax(z)``:
    ``dlogp_t/dz = onehot(t) - p`` and ``dH/dz = -p * (log p + H)``; computed in fp32, in place,
    one row block at a time.
    """
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    use_entropy = entropy is not None and grad_entropy is not None
    for rows in _row_blocks(logits.shape[0], logits.shape[-1]):
        # A copy, never an alias of ``logits`` (the head's backward may need it).
        z = logits[rows].to(torch.float32, copy=True)
        z.sub_(lse[rows].unsqueeze(-1))  # log p
        g = grad_logps[rows].unsqueeze(-1)
        if use_entropy:
            probs = z.exp()
            # -p * (g + e * (log p + H)), in place on log p.
            z.add_(entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].unsqueeze(-1)).add_(g)
            z.mul_(probs).neg_()
            del probs
        else:
            z.exp_().mul_(-g)  # -g * p
        z.scatter_add_(-1, targets[rows].unsqueeze(-1), g)  # + g * onehot(target)
        out[rows] = z
    return out


@dataclass
class _ChunkSpec:
    """The non-tensor inputs of :class:`_HeadChunkLogps` (one per compute_token_logps call)."""

    head: torch.nn.Module
    transforms: list
    return_entropy: bool
    device_type: str
    n_params: int  # how many trailing inputs of ``apply`` are head parameters


def _needs_rng_replay(head: torch.nn.Module) -> bool:
    """Does the head draw random numbers (e.g. LoRA dropout on lm_head in training mode)?"""
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
        for m in head.modules()
    )


class _HeadChunkLogps(torch.autograd.Function):
    """``log p(target)`` (and entropy) for one chunk of rows, without keeping ``[C, V]`` logits.

    Forward: ``hidden [C, H]``, ``targets [C]`` -> ``logps [C]`` (+ ``entropy [C]``), both fp32;
    only ``hidden``, ``targets`` and the per-row log-sum-exp (``[C]``) are saved. Backward
    recomputes the head's logits (in the forward's autocast state and RNG state), forms
    ``dL/dlogits`` in closed form, in place, in fp32, and backpropagates it through the head with
    ``torch.autograd.grad`` — so any head works (plain / biased / LoRA-wrapped Linear, declared
    transforms), and its parameters are explicit inputs, so their gradients flow through the
    normal (non-reentrant) autograd graph (tied weights, DDP hooks all behave).

    This is activation checkpointing specialised to a softmax head: compared with
    ``torch.utils.checkpoint`` around autograd ops it skips recomputing the log-sum-exp and
    does the softmax backward in ~4 in-place passes instead of ~10 allocating ones; the cost
    over the full path is one extra head matmul per chunk (the recompute).

    Gradients (``z``: logits, ``p = softmax(z)``, ``H`` entropy, ``g``/``e`` the incoming grads
    of logps/entropy): ``dlogp_t/dz = onehot(t) - p``; ``dH/dz = -p * (log p + H)``.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, targets: Tensor, spec: _ChunkSpec, *params: Tensor):
        dev = spec.device_type
        ctx.spec = spec
        # Unused outputs (typically a logged-only entropy) come back as None: skip their math.
        ctx.set_materialize_grads(False)
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.rng = None
        if _needs_rng_replay(spec.head):
            ctx.rng = (torch.get_rng_state(), _device_rng_state(hidden.device))
        logits = _head_logits(spec.head, spec.transforms, hidden)
        logps, lse, entropy = _softmax_stats(logits, targets, spec.return_entropy)
        del logits
        if not spec.return_entropy:
            ctx.save_for_backward(hidden, targets, lse, *params)
            return logps
        ctx.save_for_backward(hidden, targets, lse, entropy, *params)
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor | None, grad_entropy: Tensor | None = None):
        spec: _ChunkSpec = ctx.spec
        saved = ctx.saved_tensors
        hidden, targets, lse = saved[:3]
        if grad_logps is None:
            grad_logps = torch.zeros_like(lse)
        entropy = saved[3] if spec.return_entropy else None
        params = saved[len(saved) - spec.n_params :]
        enabled, dtype = ctx.autocast
        with contextlib.ExitStack() as stack:
            if ctx.rng is not None:  # replay the forward's dropout masks
                devices = [hidden.device] if hidden.device.type != "cpu" else []
                stack.enter_context(torch.random.fork_rng(devices=devices))
                torch.set_rng_state(ctx.rng[0])
                _set_device_rng_state(hidden.device, ctx.rng[1])
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autocast(spec.device_type, dtype=dtype, enabled=enabled))
            h = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
            logits = _head_logits(spec.head, spec.transforms, h)
        grad = _grad_logits(logits.detach(), targets, lse, entropy, grad_logps, grad_entropy)
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        inputs = ([h] if ctx.needs_input_grad[0] else []) + [params[i] for i in wanted]
        grads = torch.autograd.grad(logits, inputs, grad, allow_unused=True) if inputs else []
        grads = list(grads)
        grad_hidden = grads.pop(0) if ctx.needs_input_grad[0] else None
        grad_params: list[Tensor | None] = [None] * len(params)
        for i, gp in zip(wanted, grads):
            grad_params[i] = gp
        return (grad_hidden, None, None, *grad_params)


def _device_rng_state(device: torch.device) -> Tensor | None:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_device_rng_state(device: torch.device, state: Tensor | None) -> None:
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def _self_check(
    head: torch.nn.Module, transforms: list, hidden: Tensor, model_logits: Tensor
) -> bool | None:
    """Does our head + declared transforms reproduce the model's own logits?

    Shapes: ``hidden [B, 1, H]`` (the final position, sliced exactly as the model's
    ``logits_to_keep=1`` forward slices it, so the head runs the same kernel on the same input),
    ``model_logits [B, 1, V]`` (what that forward returned). ``None`` when no row is finite
    (e.g. every row is padding): inconclusive, check again on the next batch.
    """
    with torch.no_grad():
        ours = _head_logits(head, transforms, hidden)
        # The rounding unit of the coarser of the two dtypes (accelerate may have upcast the
        # model's half-precision logits to fp32 after the fact).
        eps = max(torch.finfo(ours.dtype).eps, torch.finfo(model_logits.dtype).eps)
        ours, theirs = ours.float().flatten(0, -2), model_logits.float().flatten(0, -2)
        rows = torch.isfinite(ours).all(-1) & torch.isfinite(theirs).all(-1)
        if not bool(rows.any()):
            return None
        ours, theirs = ours[rows], theirs[rows]
        # Same op, same input, same shape: equal in practice; a few ulps of slack for kernels
        # that are not bitwise reproducible. Any real transform (scale, cap, bias) is far larger,
        # unless it moves logits by less than the dtype's own rounding (see the docs).
        tol = 4 * eps * (theirs.abs() + theirs.abs().mean())
        return bool(((ours - theirs).abs() <= tol).all())


def _fused_token_logps(
    model: torch.nn.Module,
    parts: _Parts,
    kwargs: dict[str, Any],
    targets: Tensor,
    mask: Tensor,
    chunk_size: int,
    return_entropy: bool,
) -> TokenLogps | None:
    """The fused path; ``None`` when it turned itself off (the caller then runs the full path)."""
    captured: list[tuple[Tensor, bool, torch.dtype]] = []

    def grab(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if hidden is not None else output[0]
        # The autocast state *inside* the model's forward, where its own head call happens:
        # usually the caller's, but accelerate also wraps ``model.forward`` in autocast, so it
        # may be on here and off around us. The head chunks replay exactly this state.
        dev = hidden.device.type
        captured.append((hidden, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))

    # A hook on the decoder keeps only the *last* hidden state alive, unlike
    # output_hidden_states=True which would pin every layer's output until the forward returns.
    handle = parts.decoder.register_forward_hook(grab)
    try:
        # Through the outermost wrapper (DDP / PEFT / accelerate) so its forward logic still runs;
        # logits_to_keep=1 keeps the model from building [B, T, V] logits.
        out = model(**kwargs, logits_to_keep=1)
    finally:
        handle.remove()
    batch, seq = targets.shape
    if not captured or tuple(captured[-1][0].shape[:2]) != (batch, seq):
        _disable(parts.state, parts.base, "its decoder output does not line up with input_ids")
        return None
    hidden, autocast_on, autocast_dtype = captured[-1]
    captured.clear()
    autocast = torch.autocast(hidden.device.type, dtype=autocast_dtype, enabled=autocast_on)
    transforms = post_head_transforms(getattr(parts.base, "config", None))
    head = parts.head

    if not parts.state.checked:
        with autocast:
            ok = _self_check(head, transforms, hidden[:, -1:].detach(), out.logits[:, -1:])
        if ok is False:
            msg = (
                f"fused log-probs: {type(parts.base).__name__}'s own logits differ from its "
                "get_output_embeddings() output plus the config's declared post-head transforms "
                f"({', '.join(POST_HEAD_TRANSFORMS)}); it must transform logits in a way the "
                "fused path can't replay. Using the full-logits path for this model from now on."
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            _disable(parts.state, parts.base, "self-check mismatch")
            return None
        parts.state.checked = ok is True
    del out  # the [B, 1, V] logits: only needed for the self-check

    flat_targets = targets.reshape(-1)
    index = mask.reshape(-1).nonzero().squeeze(-1)
    scale = 1.0
    if index.numel() == 0:
        # No targets at all: still route one row through the head (times 0) so the result has a
        # graph and every parameter gets a (zero) gradient, as on the full path (DDP needs it).
        index, scale = index.new_zeros(1), 0.0
    rows = hidden.reshape(batch * seq, -1).index_select(0, index)
    rows_targets = flat_targets.index_select(0, index).clamp(min=0)

    # Parameters are explicit inputs so autograd routes their gradients (and skips the frozen).
    params = [p for p in head.parameters() if p.requires_grad]
    spec = _ChunkSpec(head, transforms, return_entropy, hidden.device.type, len(params))
    pieces: list[tuple[Tensor, ...]] = []
    with autocast:
        for start in range(0, rows.shape[0], chunk_size):
            out = _HeadChunkLogps.apply(
                rows[start : start + chunk_size],
                rows_targets[start : start + chunk_size],
                spec,
                *params,
            )
            pieces.append(out if isinstance(out, tuple) else (out,))

    def scatter(i: int) -> Tensor:
        values = torch.cat([p[i] for p in pieces])
        if scale != 1.0:
            values = values * scale
        zeros = values.new_zeros(batch * seq)
        return zeros.index_copy(0, index, values).view(batch, seq)

    return TokenLogps(logps=scatter(0), mask=mask, entropy=scatter(1) if return_entropy else None)


__all__ = [
    "IGNORE_INDEX",
    "POST_HEAD_TRANSFORMS",
    "TokenLogps",
    "compute_token_logps",
    "logps_from_logits",
    "post_head_transforms",
    "shift_labels",
]
