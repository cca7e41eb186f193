"""``Reference``: the frozen reference policy ``pi_ref`` for every method that compares with one.

DPO, IPO, KTO and the online methods with a KL term or DPO-style scores all ask one question:
what are ``log pi_ref(y | x)`` for these tokens? The answer comes from one of these sources, in
this order of precedence:

1. **cached columns** in the batch (``ref_chosen_logps`` ..., written once before training by
   :func:`grimoire.forward.precomputed.cache_reference_log_probs`); offline methods only, since online
   completions are new every step;
2. **an explicit ``ref_model``**: cast to the policy's dtype (unless quantized), moved to its
   device, frozen, eval mode; never wrapped by DDP/FSDP (it has no gradients to sync);
3. **the policy's own base weights** when the policy is a peft (LoRA) model, or any model with
   a ``disable_adapter()`` context manager (grimoire-rl's duck-typed contract: the model without
   its adapters is the reference): adapters disabled, eval mode; no second copy of the weights;
4. ``ref_model="copy"``: a frozen copy of the policy as it is when training starts. Opt-in,
   because it doubles the model's memory; nothing copies the policy silently.

With ``TrainingConfig.precompute_ref_log_probs`` the chosen source runs once, before training
(:func:`grimoire.forward.precomputed.precompute_reference`), and is then released: training reads the
cached columns only. There the starting policy itself is the reference for ``"copy"`` (and for no
source at all): nothing has trained it yet, so no copy is needed (except under FSDP2, where the
copy is sharded rather than gathering the whole policy on every device).

With none of these, :meth:`Reference.setup` raises a :class:`~grimoire.errors.ConfigError` that
names every fix, before the first step. Reference forwards run under ``no_grad`` inside the
trainer's autocast, so they use the policy's precision.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from grimoire.columns import columns_of
from grimoire.config.context import TrainingContext
from grimoire.errors import ConfigError
from grimoire.forward.logprobs import TokenLogps, compute_token_logps

logger = logging.getLogger(__name__)

#: The ``ref_model`` value that asks for a frozen copy of the starting policy.
COPY = "copy"
#: Column recording which reduction cached reference log-probs were computed with.
REDUCTION_COLUMN = "ref_logps_reduction"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP-style wrappers (``.module``), else ``model`` itself."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def has_adapter_switch(model: torch.nn.Module) -> bool:
    """True for a peft model, or any model exposing ``disable_adapter()`` (a context manager
    under which it runs without its adapters; grimoire-rl's contract for "the base is the
    reference"). transformers' own ``disable_adapters()`` (plural, not a context manager) is not
    one."""
    return is_peft_model(model) or callable(getattr(model, "disable_adapter", None))


def is_quantized(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None))


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The policy's compute dtype: its input embeddings' (LoRA adapters may be float32)."""
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class Reference:
    """Reference log-probs for one method (see the module docstring for the sources).

    Args:
        ref_model: an explicit frozen reference, ``"copy"``, or None.
        owner: the method's name, for messages.
        cache_columns: batch columns that hold cached reference log-probs (empty for online
            methods).
    """

    def __init__(
        self,
        ref_model: torch.nn.Module | str | None,
        owner: str,
        cache_columns: tuple[str, ...] = (),
    ):
        if isinstance(ref_model, str) and ref_model != COPY:
            raise ValueError(
                f"{owner}: ref_model must be a model, {COPY!r} or None, got {ref_model!r}"
            )
        self.ref_model = ref_model
        self.owner = owner
        self.cache_columns = cache_columns
        # "model" | "copy" | "adapters" | "policy" (the untrained policy, precompute only) |
        # "none" (cached columns only) | "cached" (released after precompute)
        self.source = "unset"
        self._peft_model: torch.nn.Module | None = None

    # ---------------------------------------------------------------- set-up

    def setup(self, ctx: TrainingContext, expected_reduction: str | None = None) -> None:
        """Place the reference, and check every dataset has a source (else raise, naming fixes).

        ``ctx`` gives ``unwrapped_model``, ``accelerator``, ``train_dataset``, ``eval_dataset``,
        how to prepare a frozen model beside the policy and whether it is sharded.
        """
        policy = ctx.unwrapped_model
        device = ctx.accelerator.device
        prepare = ctx.prepare_frozen
        # Before training the policy IS the starting policy: a precompute pass needs no copy of it.
        precompute = bool(self.cache_columns) and ctx.config.precompute_ref_log_probs
        use_policy = precompute and not ctx.sharded
        if self.ref_model == COPY and use_policy:
            logger.info("%s: reference = the starting policy (precomputed, no copy)", self.owner)
            self.ref_model, self.source = None, "policy"
        elif self.ref_model == COPY:
            logger.info("%s: reference = a frozen copy of the starting policy", self.owner)
            self.ref_model = prepare(self._freeze(copy.deepcopy(unwrap(policy)), device))
            self.source = "copy"
        elif isinstance(self.ref_model, torch.nn.Module):  # (a string is COPY, checked above)
            ref = self._freeze(self._match_policy(self.ref_model, policy), device)
            self.ref_model = prepare(ref)
            self.source = "model"
        elif has_adapter_switch(unwrap(policy)):
            self._peft_model, self.source = unwrap(policy), "adapters"
        elif use_policy:
            logger.info("%s: reference = the starting policy (precomputed)", self.owner)
            self.source = "policy"
        elif precompute:  # sharded: a sharded frozen copy, released after the precompute pass
            self.ref_model = prepare(self._freeze(copy.deepcopy(unwrap(policy)), device))
            self.source = "copy"
        else:
            self.source = "none"
        problems = []
        for split, ds in (("train", ctx.train_dataset), ("eval", ctx.eval_dataset)):
            if ds is None:
                continue
            cols = set(columns_of(ds))
            if self.cache_columns and all(c in cols for c in self.cache_columns):
                found = ds[0][REDUCTION_COLUMN] if REDUCTION_COLUMN in cols and len(ds) else None
                if expected_reduction and found is not None and found != expected_reduction:
                    problems.append(
                        f"{self.owner}: the {split} dataset's cached reference log-probs are "
                        f"{found!r}-reduced but the loss uses logp_reduction="
                        f"{expected_reduction!r}; re-run cache_reference_log_probs(..., "
                        f"reduction={expected_reduction!r})"
                    )
            elif self.source == "none":
                problems.append(self._missing(split))
        if problems:
            raise ConfigError(problems)

    def _missing(self, split: str) -> str:
        cache = (
            f", or precompute columns {list(self.cache_columns)}: "
            "training.precompute_ref_log_probs=true (the starting policy, scored once before "
            "training) or grimoire.forward.precomputed.cache_reference_log_probs"
            if self.cache_columns
            else ""
        )
        return (
            f"{self.owner} needs reference log-probs for the {split} dataset and has no source: "
            "pass ref_model=<a frozen copy of the starting model>, ref_model='copy' (copies the "
            "policy when training starts: twice the model's memory), or train with "
            "peft_config=LoraConfig(...) or a policy with a disable_adapter() context manager "
            f"(the model with adapters disabled){cache}"
        )

    def _match_policy(self, ref: torch.nn.Module, policy: torch.nn.Module) -> torch.nn.Module:
        dtype, ref_dtype = model_dtype(policy), model_dtype(ref)
        if not is_quantized(ref) and dtype is not None and ref_dtype not in (None, dtype):
            # Same weights precision as the policy: otherwise policy and reference differ by
            # rounding alone and the implicit rewards / KL are not 0 at step 0.
            logger.info("%s: casting ref_model from %s to %s", self.owner, ref_dtype, dtype)
            ref = ref.to(dtype)
        return ref

    @staticmethod
    def _freeze(ref: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if not is_quantized(ref):
            ref = ref.to(device)
        ref.eval()
        ref.requires_grad_(False)
        return ref

    def release(self) -> None:
        """Drop the reference model after a precompute pass: from here on only cached columns
        are read (a batch without them is an error, never a silent fallback)."""
        self.ref_model, self._peft_model, self.source = None, None, "cached"

    # ---------------------------------------------------------------- use

    def cached(self, batch: dict[str, Any], expected_reduction: str) -> tuple[Tensor, ...] | None:
        """The cached columns as float tensors when the batch has them all, else None."""
        if not self.cache_columns or not all(c in batch for c in self.cache_columns):
            return None
        found = batch.get(REDUCTION_COLUMN)
        if isinstance(found, list | tuple):
            found = found[0] if found else None
        if found is not None and found != expected_reduction:
            raise ValueError(
                f"{self.owner}: cached reference log-probs are {found!r}-reduced but "
                f"logp_reduction={expected_reduction!r}"
            )
        return tuple(torch.as_tensor(batch[c]).float() for c in self.cache_columns)

    @contextlib.contextmanager
    def model(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The module whose forward is the reference forward (no-grad use only).

        ``policy`` is the (possibly wrapped) training model; with adapters disabled it is called
        itself rather than the peft model inside, so a sharding wrapper can gather its weights.
        """
        if isinstance(self.ref_model, torch.nn.Module):
            yield self.ref_model
            return
        if self.source == "cached":
            raise RuntimeError(
                f"{self.owner}: the reference model was released after precompute_ref_log_probs "
                f"but a batch has no cached columns {list(self.cache_columns)}"
            )
        if self.source == "policy":  # precompute only: the policy before any training step
            with eval_mode(unwrap(policy)):
                yield policy
            return
        peft_model = self._peft_model
        if peft_model is None and has_adapter_switch(unwrap(policy)):
            peft_model = unwrap(policy)  # used without setup (e.g. directly in tests)
        if peft_model is None:
            raise ConfigError([self._missing("train")])
        # A peft model, or any module with a disable_adapter() context manager (not typed by torch).
        switch: Any = peft_model
        # Eval mode so dropout does not perturb the reference.
        with eval_mode(peft_model), switch.disable_adapter():
            yield policy

    def compute(self, policy: torch.nn.Module, *, fused: bool, chunk_size: int) -> Any:
        """``compute(ids, labels, mask, position_ids, layout) -> TokenLogps`` for the reference, the
        no-grad twin of :func:`grimoire.losses.preference.policy_compute`."""

        def compute(ids, labels, mask, position_ids, layout=None):
            return self.token_logps(
                policy,
                ids,
                labels,
                mask,
                fused=fused,
                chunk_size=chunk_size,
                position_ids=position_ids,
                layout=layout,
            )

        return compute

    @torch.no_grad()
    def token_logps(
        self,
        policy: torch.nn.Module,
        input_ids: Tensor,
        labels: Tensor,
        attention_mask: Tensor | None,
        *,
        fused: bool,
        chunk_size: int,
        position_ids: Tensor | None = None,
        layout: Any = None,
    ) -> TokenLogps:
        """Reference per-token log-probs of ``labels`` (no gradient)."""
        with self.model(policy) as ref:
            return compute_token_logps(
                ref,
                input_ids,
                labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                fused=fused,
                chunk_size=chunk_size,
                layout=layout,
            )


__all__ = [
    "COPY",
    "REDUCTION_COLUMN",
    "Reference",
    "eval_mode",
    "has_adapter_switch",
    "is_peft_model",
    "is_quantized",
    "model_dtype",
    "unwrap",
]
