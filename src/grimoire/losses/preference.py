"""Model-facing machinery shared by the offline preference losses.

- :func:`pair_token_logps`: ONE forward over chosen and rejected stacked along the batch
  dimension (``[2B, T]``), so a DDP/FSDP-wrapped model is called once per micro-batch and the
  two halves see the same weights, dropout state and kernels.
- :class:`ReferenceLogps`: where reference log-probs come from, in this order:
  (3) cached columns in the batch (``ref_chosen_logps``/``ref_rejected_logps``, KTO
  ``ref_logps``/``ref_kl_logps``, from :func:`grimoire.data.cache.cache_reference_log_probs`);
  (1) an explicit ``ref_model`` (moved to the device, eval mode, frozen; never DDP-wrapped);
  (2) a LoRA policy with its adapters disabled (no second copy of the weights).
  Reference forwards run under ``no_grad`` inside the trainer's autocast, so they use the same
  precision as the policy forward.
- :class:`PairwiseLoss`: the common base of the pairwise losses (columns, collator, weight).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..data.preference import PREFERENCE_COLUMNS, PreferenceCollator, pad_right
from ..errors import ConfigError
from ..logprobs import IGNORE_INDEX, TokenLogps, compute_token_logps
from .base import GrimoireLoss

logger = logging.getLogger(__name__)

LOGP_REDUCTIONS: tuple[str, ...] = ("sum", "mean")
#: Column recording which reduction cached reference log-probs were computed with.
REDUCTION_COLUMN = "ref_logps_reduction"


def check_reduction(value: str, owner: str) -> str:
    if value not in LOGP_REDUCTIONS:
        raise ValueError(
            f"{owner}: logp_reduction must be one of {list(LOGP_REDUCTIONS)}, got {value!r}"
        )
    return value


def reduce_logps(logps: TokenLogps, reduction: str) -> Tensor:
    """Per-row sequence log-prob ``[B]``: summed, or averaged over the row's trained tokens."""
    return logps.sum() if reduction == "sum" else logps.mean()


def scalar_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-example ``[B]`` metrics -> detached float scalars (means over the micro-batch)."""
    return {k: v.detach().float().mean() for k, v in metrics.items()}


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


def stack_rows(
    parts: list[tuple[Tensor, Tensor, Tensor]], pad_value: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Stack several ``(input_ids, attention_mask, labels)`` groups into one ``[sum B, T]``.

    Groups are right-padded to a common width first: the padded positions are masked and
    labelled -100, and with right padding a causal model's outputs at real positions are
    unaffected, so the result is exactly that of separate forwards.
    """
    width = max(ids.shape[1] for ids, _, _ in parts)
    ids = torch.cat([pad_right(i, width, pad_value) for i, _, _ in parts])
    mask = torch.cat([pad_right(m, width, 0) for _, m, _ in parts])
    labels = torch.cat([pad_right(lab, width, IGNORE_INDEX) for _, _, lab in parts])
    return ids, mask, labels


def pair_rows(batch: dict[str, Any], pad_value: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``[2B, T]`` input_ids / attention_mask / labels: chosen rows first, then rejected."""
    parts = []
    for side in ("chosen_", "rejected_"):
        ids = batch[f"{side}input_ids"]
        mask = batch.get(f"{side}attention_mask")
        labels = batch.get(f"{side}labels")
        parts.append(
            (
                ids,
                mask if mask is not None else torch.ones_like(ids),
                labels if labels is not None else ids,
            )
        )
    return stack_rows(parts, pad_value)


def split_logps(out: TokenLogps, n: int) -> tuple[TokenLogps, TokenLogps]:
    """Split a stacked result into its first ``n`` rows and the rest."""
    return (
        TokenLogps(out.logps[:n], out.mask[:n]),
        TokenLogps(out.logps[n:], out.mask[n:]),
    )


def unpack_rows(out: TokenLogps, seq_lens: Tensor) -> TokenLogps:
    """A packed ``[1, L]`` result laid out as ``[num_samples, max_len]`` rows (zeros past each
    sample's end), i.e. exactly what the same samples padded would give."""
    lens = seq_lens.to(out.logps.device)
    width = int(lens.max())
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(width, device=lens.device)
    valid = offsets[None, :] < lens[:, None]
    index = (starts[:, None] + offsets[None, :]).clamp(max=out.logps.shape[1] - 1)
    logps = out.logps[0][index].masked_fill(~valid, 0.0)
    return TokenLogps(logps, out.mask[0][index] & valid)


def pair_forward(batch: dict[str, Any], compute: Any) -> tuple[TokenLogps, TokenLogps]:
    """Chosen / rejected per-token log-probs from one forward, padded or packed.

    ``compute(input_ids, labels, attention_mask, position_ids) -> TokenLogps``. Padded batches
    stack chosen over rejected (``[2B, T]``); packed ones (from :class:`PackedPairCollator`) hold
    the ``2B`` samples in one row, chosen first, and are unpacked back to rows.
    """
    if "seq_lens" in batch:
        out = compute(batch["input_ids"], batch["labels"], None, batch["position_ids"])
        rows = unpack_rows(out, batch["seq_lens"])
        return split_logps(rows, int(batch["seq_lens"].shape[0]) // 2)
    ids, mask, labels = pair_rows(batch)
    return split_logps(compute(ids, labels, mask, None), batch["chosen_input_ids"].shape[0])


def num_pairs(batch: dict[str, Any]) -> int:
    if "seq_lens" in batch:
        return int(batch["seq_lens"].shape[0]) // 2
    return int(batch["chosen_input_ids"].shape[0])


def policy_compute(
    model: torch.nn.Module, *, fused: bool, chunk_size: int
) -> Callable[..., TokenLogps]:
    """``compute(ids, labels, mask, position_ids)`` for :func:`pair_forward` and the KTO parts:
    the model's per-token log-probs, with gradient."""

    def compute(ids, labels, mask, position_ids):
        return compute_token_logps(
            model,
            ids,
            labels,
            attention_mask=mask,
            position_ids=position_ids,
            fused=fused,
            chunk_size=chunk_size,
        )

    return compute


def pair_token_logps(
    model: torch.nn.Module, batch: dict[str, Any], *, fused: bool, chunk_size: int
) -> tuple[TokenLogps, TokenLogps]:
    """Per-token log-probs of the chosen and rejected responses from one concatenated forward."""
    return pair_forward(batch, policy_compute(model, fused=fused, chunk_size=chunk_size))


class PackedPairCollator:
    """Padding-free pairs: the micro-batch's chosen then rejected responses as one packed row.

    Other numeric columns (cached reference log-probs, margins) are stacked as tensors.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        from ..data.packing import pack_row_sides

        sides = ("chosen_", "rejected_")
        return pack_row_sides(features, sides, self.pad_token_id, lambda key: key.startswith(sides))


def _dataset_columns(dataset: Any) -> set[str]:
    if dataset is None:
        return set()
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0].keys()) if len(dataset) else []
    return set(names)


def _first_value(dataset: Any, column: str) -> Any:
    return dataset[0][column] if len(dataset) else None


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The policy's compute dtype: its input embeddings' (LoRA adapters may be float32)."""
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


class ReferenceLogps:
    """Reference log-probs for a loss: cached columns, a frozen model, or disabled adapters.

    Args:
        ref_model: an explicit frozen reference (option 1) or None.
        owner: the loss's name, for error messages.
        cache_columns: the batch columns that hold cached reference log-probs (option 3).
    """

    def __init__(
        self, ref_model: torch.nn.Module | None, owner: str, cache_columns: tuple[str, ...]
    ):
        self.ref_model = ref_model
        self.owner = owner
        self.cache_columns = cache_columns
        self._peft_model: torch.nn.Module | None = None

    # ---------------------------------------------------------------- set-up

    def setup(self, trainer: Any, expected_reduction: str) -> None:
        """Freeze and place the reference, or check that another source exists (else raise)."""
        policy = trainer.unwrapped_model
        if self.ref_model is not None:
            ref = self.ref_model
            quantized = getattr(ref, "is_quantized", False) or getattr(ref, "hf_quantizer", None)
            dtype, ref_dtype = model_dtype(policy), model_dtype(ref)
            if not quantized and dtype is not None and ref_dtype is not None and dtype != ref_dtype:
                # Same weights precision as the policy: otherwise policy and reference differ by
                # rounding alone and the implicit rewards are not 0 at step 0.
                logger.info(
                    "%s: casting ref_model from %s to the policy's %s", self.owner, ref_dtype, dtype
                )
                ref = ref.to(dtype)
            if not quantized:
                ref = ref.to(trainer.accelerator.device)
            ref.eval()
            ref.requires_grad_(False)
            self.ref_model = ref
        elif is_peft_model(policy):
            self._peft_model = policy
        splits = (("train", trainer.train_dataset), ("eval", trainer.eval_dataset))
        problems = []
        for split, ds in splits:
            if ds is None:
                continue
            cols = _dataset_columns(ds)
            cached = all(c in cols for c in self.cache_columns)
            if cached:
                found = _first_value(ds, REDUCTION_COLUMN) if REDUCTION_COLUMN in cols else None
                if found is not None and found != expected_reduction:
                    problems.append(
                        f"{self.owner}: the {split} dataset's cached reference log-probs are "
                        f"{found!r}-reduced but the loss uses logp_reduction="
                        f"{expected_reduction!r}; re-run cache_reference_log_probs(..., "
                        f"reduction={expected_reduction!r})"
                    )
            elif self.ref_model is None and self._peft_model is None:
                problems.append(
                    f"{self.owner} needs reference log-probs for the {split} dataset and has none: "
                    "pass ref_model=<a frozen copy of the starting model>, train with "
                    "peft_config=LoraConfig(...) (the base model with adapters disabled is the "
                    "reference), or precompute columns "
                    f"{list(self.cache_columns)} with grimoire.data.cache.cache_reference_log_probs"
                )
        if problems:
            raise ConfigError(problems)

    # ---------------------------------------------------------------- use

    def cached(self, batch: dict[str, Any], expected_reduction: str) -> tuple[Tensor, ...] | None:
        """The cached columns as float tensors when the batch has them all, else None."""
        if not all(c in batch for c in self.cache_columns):
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
    def _reference_model(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Yield the module whose forward is the reference forward."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        peft_model = self._peft_model
        if peft_model is None and is_peft_model(unwrap(policy)):
            peft_model = unwrap(policy)  # called without trainer.setup (e.g. directly in tests)
        if peft_model is None:
            raise ConfigError(
                [
                    f"{self.owner}: no reference: pass ref_model=, train a LoRA policy, or add "
                    f"cached columns {list(self.cache_columns)} "
                    "(grimoire.data.cache.cache_reference_log_probs)"
                ]
            )
        # The wrapped policy is called (not the peft model inside it) so FSDP can gather its
        # shards; eval mode so dropout does not perturb the reference.
        was_training = peft_model.training
        peft_model.eval()
        try:
            with peft_model.disable_adapter():
                yield policy
        finally:
            peft_model.train(was_training)

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
    ) -> TokenLogps:
        """Reference per-token log-probs of ``labels`` (no gradient)."""
        with self._reference_model(policy) as ref:
            return compute_token_logps(
                ref,
                input_ids,
                labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                fused=fused,
                chunk_size=chunk_size,
            )

    def pair_logps(
        self, policy: torch.nn.Module, batch: dict[str, Any], *, fused: bool, chunk_size: int
    ) -> tuple[TokenLogps, TokenLogps]:
        """Reference chosen / rejected per-token log-probs, padded or packed batch alike."""

        def compute(ids, labels, mask, position_ids):
            return self.token_logps(
                policy,
                ids,
                labels,
                mask,
                fused=fused,
                chunk_size=chunk_size,
                position_ids=position_ids,
            )

        return pair_forward(batch, compute)


class PairwiseLoss(GrimoireLoss):
    """Shared plumbing of the pairwise losses: columns, collator and one weight unit per pair."""

    required_columns = PREFERENCE_COLUMNS

    def __init__(self, fused: bool = True, fused_chunk_size: int = 1024):
        if fused_chunk_size <= 0:
            raise ValueError(f"fused_chunk_size must be > 0, got {fused_chunk_size}")
        self.fused = fused
        self.fused_chunk_size = fused_chunk_size

    def policy_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[TokenLogps, TokenLogps]:
        return pair_token_logps(model, batch, fused=self.fused, chunk_size=self.fused_chunk_size)

    def create_collator(self, pad_token_id: int) -> PreferenceCollator:
        return PreferenceCollator(pad_token_id=pad_token_id)

    def create_packed_collator(self, pad_token_id: int) -> PackedPairCollator:
        return PackedPairCollator(pad_token_id)

    def loss_weight(self, batch: dict[str, Any]) -> float:
        """One unit per preference pair: the loss is a mean over pairs."""
        return float(num_pairs(batch))


def chosen_nll(chosen: TokenLogps) -> Tensor:
    """Token-mean NLL over all of the micro-batch's chosen tokens (CPO / ORPO's SFT term)."""
    return -chosen.logps.sum() / chosen.mask.sum().clamp(min=1)


__all__ = [
    "LOGP_REDUCTIONS",
    "REDUCTION_COLUMN",
    "PackedPairCollator",
    "PairwiseLoss",
    "ReferenceLogps",
    "check_reduction",
    "chosen_nll",
    "is_peft_model",
    "model_dtype",
    "num_pairs",
    "pair_forward",
    "pair_rows",
    "pair_token_logps",
    "policy_compute",
    "reduce_logps",
    "scalar_metrics",
    "split_logps",
    "stack_rows",
    "unwrap",
]
