"""The fused log-prob path: the LM head run in chunks, its logits never kept for backward.

Stage: :func:`grimoire.forward.logprobs.compute_token_logps` calls :func:`fused_parts` to learn
whether a model can take this path (an output embedding that is unsharded or in an FSDP2 unit it
can gather, :mod:`~grimoire.forward.head.sharded`; a reachable decoder; a forward that accepts
``logits_to_keep``), then :func:`fused_token_logps`, which runs the model with
``logits_to_keep=1``, captures the decoder's last hidden state with a forward hook, checks once
per model that the head plus the declared post-head transforms reproduce the model's own logits
(:func:`_self_check`), and pushes the positions that have a target through the head
``chunk_size`` rows at a time (:class:`~grimoire.forward.head.function._HeadLogps`, an autograd
Function specialised to a softmax head that either recomputes the logits in backward, like
activation checkpointing, or, for a token-mean loss, computes the head's gradients during the
forward; RNG state is replayed for heads with dropout). Peak logits memory is
``chunk_size x V`` instead of ``B x T x V``. See ``docs/fused-logprobs.md``.
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from grimoire.errors import ConfigError, GrimoireRuntimeWarning
from grimoire.forward.head.function import _head_logits, _HeadLogps, _HeadSpec
from grimoire.forward.head.sharded import (
    gathered,
    head_unit,
    is_dtensor,
    root_unit,
    unshard_in_backward,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The public entry point lives in grimoire.forward.logprobs, and so does the logger name users
# filter on.
logger = logging.getLogger("grimoire.forward.logprobs")


@dataclass
class _FusedState:
    """What we learned about one model: set once, kept for the model's lifetime."""

    checked: bool = False  # the self-check passed
    disabled: str | None = None  # why the fused path is off for good (None: it is on)


# The self-check verdict, keyed by the unwrapped CausalLM so DDP / PEFT wrappers of one model
# share it; weak so a deleted model takes its entry with it.
_STATE: weakref.WeakKeyDictionary[torch.nn.Module, _FusedState] = weakref.WeakKeyDictionary()
# Structural support (head present, not sharded, decoder reachable), keyed by the object passed
# in, with its class: the same model may be fine bare and unsupported once wrapped (FSDP, ZeRO-3;
# ``fully_shard`` changes the class of the module it shards, in place).
_SUPPORT: weakref.WeakKeyDictionary[torch.nn.Module, tuple[type, str | None]] = (
    weakref.WeakKeyDictionary()
)
# FSDP2 only: the unit owning the head's weight, and the units to gather again in backward.
_UNITS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


@dataclass
class _Parts:
    base: torch.nn.Module  # the CausalLM (under any DDP / PEFT wrappers)
    decoder: torch.nn.Module  # whose output (last_hidden_state) feeds the head
    head: torch.nn.Module  # get_output_embeddings(): nn.Linear, LoRA-wrapped Linear, ...
    state: _FusedState
    unit: torch.nn.Module | None = None  # the FSDP2 unit owning the head's weight (or None)
    units: tuple[torch.nn.Module, ...] = ()  # FSDP2 units to gather again in backward


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The CausalLM inside DDP / DataParallel / DeepSpeed / torch.compile / PEFT wrappers."""
    for _ in range(8):  # wrappers nest a few levels at most; never loop forever
        if isinstance(
            model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel
        ) or type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine"):
            model = cast(torch.nn.Module, model.module)  # each wrapper's wrapped module
        elif isinstance(compiled := getattr(model, "_orig_mod", None), torch.nn.Module):
            model = compiled  # torch.compile's original module
        elif _from_peft(model) and callable(get_base := getattr(model, "get_base_model", None)):
            inner = cast(torch.nn.Module, get_base())  # peft's transformers model
            if inner is model:
                break
            model = inner
        else:
            break
    return model


def _from_peft(model: torch.nn.Module) -> bool:
    """A peft wrapper, also once ``fully_shard`` has swapped in its subclass (``FSDPPeftModel``)."""
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _is_sharded(param: Tensor) -> bool:
    """A DeepSpeed ZeRO-3 partitioned param or an FSDP1 flat-param stub (an FSDP2 DTensor is
    sharded too, but the fused path gathers it: :mod:`grimoire.forward.head.sharded`)."""
    if hasattr(param, "ds_numel") or hasattr(param, "ds_id"):
        return True
    return param.numel() == 0 and not is_dtensor(param)


def _unsupported_reason(model: torch.nn.Module, base: torch.nn.Module) -> str | None:
    """Why the fused path cannot serve ``model`` (``None``: it can)."""
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module):
        return "the model has no output embeddings (get_output_embeddings() is None)"
    if any(_is_sharded(p) for p in head.parameters()):
        return "the LM head's weight is sharded (DeepSpeed ZeRO-3 / FSDP1)"
    if root_unit(model) is not None:  # FSDP2: the head is gathered around the chunk loop
        reason = head_unit(model, head)[1]
        if reason is not None:
            return reason
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


def fused_parts(model: torch.nn.Module, require: bool = False) -> _Parts | None:
    """Decoder and head for the fused path, or ``None`` to use the full path (logged once).

    ``require=True`` (a loss built with ``fused="require"``) turns a structural reason to fall
    back (sharded head, FSDP1 wrapper, no decoder, no ``logits_to_keep``) into a ``ConfigError``
    instead: the full ``[B, T, V]`` logits the fallback builds may not fit where the fused path
    was counted on.
    """
    base = _unwrap(model)
    if _SUPPORT.get(model, (None,))[0] is not type(model):
        reason = _unsupported_reason(model, base)
        _SUPPORT[model] = (type(model), reason)
        if reason is not None and not require:
            logger.info(
                "fused log-probs off for %s: %s; using full logits", type(base).__name__, reason
            )
    reason = _SUPPORT[model][1]
    if reason is not None:
        if require:
            raise ConfigError(
                [
                    f"fused='require': the fused log-prob path cannot run on "
                    f"{type(base).__name__}: {reason}. Fix: keep the LM head unsharded (DeepSpeed "
                    "ZeRO stage <= 2, FSDP2 with lm_head in its parent's unit), or build the loss "
                    "with fused=True to fall back to full [batch, seq, vocab] logits"
                ]
            )
        return None
    state = _STATE.setdefault(base, _FusedState())
    if state.disabled is not None:
        return None
    # _unsupported_reason found a head and a decoder: a transformers CausalLM.
    causal_lm = cast("PreTrainedModel", base)
    head = causal_lm.get_output_embeddings()
    assert head is not None, "checked by _unsupported_reason"
    if _UNITS.get(model, (None,))[0] is not type(model):
        # FSDP2: gather the head's unit around the chunk loop, and in backward the root too
        # (its pre-backward hook sits on the model's own logits, which this path drops).
        root = root_unit(model)
        unit = head_unit(model, head)[0] if root is not None else None
        units = tuple(dict.fromkeys(u for u in (unit, root) if u is not None))
        _UNITS[model] = (type(model), unit, units)
    _, unit, units = _UNITS[model]
    return _Parts(
        base=base, decoder=causal_lm.get_decoder(), head=head, state=state, unit=unit, units=units
    )


def _disable(state: _FusedState, base: torch.nn.Module, reason: str) -> None:
    state.disabled = reason
    logger.info("fused log-probs off for %s: %s; using full logits", type(base).__name__, reason)


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


def fused_token_logps(
    model: torch.nn.Module,
    parts: _Parts,
    transforms: list[tuple[Callable[[Tensor, float], Tensor], float]],
    kwargs: dict[str, Any],
    targets: Tensor,
    mask: Tensor,
    chunk_size: int,
    return_entropy: bool,
    uniform_grad: bool = False,
    num_targets: int | None = None,
) -> tuple[Tensor, Tensor | None] | None:
    """The fused path: ``(logps, entropy)``, both ``[B, T]`` fp32 and 0 where ``mask`` is False
    (``entropy`` None unless asked), or ``None`` when the path turned itself off for this model
    (the caller then runs the full path). ``transforms`` are replayed after the head, in order.
    ``num_targets``: ``mask``'s True count when the caller knows it on the host (the collator
    counted it), so the head's rows are gathered without a ``nonzero`` (a host sync).
    """
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
    if not captured or tuple(captured[-1][0].shape[:2]) != tuple(targets.shape):
        _disable(parts.state, parts.base, "its decoder output does not line up with input_ids")
        return None
    hidden, autocast_on, autocast_dtype = captured[-1]
    captured.clear()
    autocast = torch.autocast(hidden.device.type, dtype=autocast_dtype, enabled=autocast_on)

    with gathered(parts.unit, parts.head) as whole:  # FSDP2: the head's weight all-gathered here
        if not whole:
            _disable(parts.state, parts.base, "its FSDP2 unit does not own the LM head's weight")
            return None
        if not _checked(parts, transforms, autocast, hidden, out):
            return None
        del out  # the [B, 1, V] logits: only needed for the self-check
        logps = _apply_head(
            parts,
            transforms,
            autocast,
            hidden,
            targets,
            mask,
            chunk_size,
            return_entropy,
            uniform_grad,
            num_targets,
        )
    return logps


def _checked(parts: _Parts, transforms: list, autocast: Any, hidden: Tensor, out: Any) -> bool:
    """Run the self-check once per model; ``False``: it failed, the fused path is now off."""
    if parts.state.checked:
        return True
    with autocast:
        ok = _self_check(parts.head, transforms, hidden[:, -1:].detach(), out.logits[:, -1:])
    if ok is False:
        msg = (
            f"fused log-probs: {type(parts.base).__name__}'s own logits differ from its "
            "get_output_embeddings() output plus the post-head transforms its config declares "
            "(grimoire.forward.logprobs.POST_HEAD_TRANSFORMS); it must transform logits in a way the "
            "fused path can't replay. Using the full-logits path for this model from now on."
        )
        warnings.warn(msg, GrimoireRuntimeWarning, stacklevel=4)
        _disable(parts.state, parts.base, "self-check mismatch")
        return False
    parts.state.checked = ok is True
    return True


def _apply_head(
    parts: _Parts,
    transforms: list,
    autocast: Any,
    hidden: Tensor,
    targets: Tensor,
    mask: Tensor,
    chunk_size: int,
    return_entropy: bool,
    uniform_grad: bool,
    num_targets: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The head on the rows that have a target, ``chunk_size`` rows at a time: ``(logps,
    entropy)`` scattered back to ``[B, T]`` (0 elsewhere)."""
    batch, seq = targets.shape
    head = parts.head
    flat_targets = targets.reshape(-1)
    if num_targets is None:
        index = mask.reshape(-1).nonzero().squeeze(-1)  # reads the count back: a host sync
    else:
        index = target_index(mask.reshape(-1), num_targets)
    scale = 1.0
    if index.numel() == 0:
        # No targets at all: still route one row through the head (times 0) so the result has a
        # graph and every parameter gets a (zero) gradient, as on the full path (DDP needs it).
        index, scale = index.new_zeros(1), 0.0
    rows = hidden.reshape(batch * seq, -1).index_select(0, index)
    rows_targets = flat_targets.index_select(0, index).clamp(min=0)

    # Parameters are explicit inputs so autograd routes their gradients (and skips the frozen).
    params = [p for p in head.parameters() if p.requires_grad]
    spec = _HeadSpec(
        head,
        transforms,
        return_entropy,
        hidden.device.type,
        len(params),
        chunk_size,
        uniform_grad,
    )
    with autocast:
        out = _HeadLogps.apply(rows, rows_targets, spec, *params)
    pieces = unshard_in_backward(parts.units, out if isinstance(out, tuple) else (out,))

    def scatter(i: int) -> Tensor:
        values = pieces[i]
        if scale != 1.0:
            values = values * scale
        zeros = values.new_zeros(batch * seq)
        return zeros.index_copy(0, index, values).view(batch, seq)

    return scatter(0), scatter(1) if return_entropy else None


def target_index(flat_mask: Tensor, count: int) -> Tensor:
    """``flat_mask.nonzero().squeeze(-1)`` given its length ``count`` from the host: the same
    ``[count]`` positions, in order, from a cumulative sum and a scatter of fixed shapes, so
    nothing is read back from the device. Every True position ``i`` writes ``i`` to slot
    ``cumsum(mask)[i] - 1``; the others write to a spare last slot, dropped. A ``count`` that
    is not the mask's (a layout that does not belong to these rows) fails a device-side assert.
    """
    # A device-side assert (no host sync); torch has no public name for it.
    torch._assert_async(  # pyright: ignore[reportPrivateImportUsage]
        flat_mask.sum() == count, "the layout's target count is not the mask's"
    )
    slot = torch.where(flat_mask, flat_mask.cumsum(0) - 1, count).clamp(max=count)
    positions = torch.arange(flat_mask.numel(), device=flat_mask.device)
    out = torch.zeros(count + 1, dtype=torch.long, device=flat_mask.device)
    return out.scatter_(0, slot, positions)[:count]


__all__ = ["fused_parts", "fused_token_logps", "target_index"]
