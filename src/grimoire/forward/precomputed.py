"""Precompute a frozen reference model's log-probs once, so training needs no reference forward.

:func:`cache_reference_log_probs` adds columns that DPO/IPO (``ref_chosen_logps``,
``ref_rejected_logps``) and KTO (``ref_logps``, ``ref_kl_logps``) read instead of running a
reference model: the reference costs one pass over the data instead of one forward per step, and
need not be in memory while training.

KTO: its KL term uses mismatched pairs. In-batch pairs depend on how rows are batched, so they
cannot be cached; here the pairs are fixed at dataset level instead (row ``i``'s prompt with row
``(i + 1) mod N``'s completion) and written as ``kl_input_ids``/``kl_attention_mask``/
``kl_labels`` next to ``ref_kl_logps``; the ``KTOCollator`` then uses those pairs. Rows sharing a
prompt should not be adjacent (shuffle the dataset first), or their "mismatched" pair is not.

A ``ref_logps_reduction`` column records the reduction, and the losses refuse cached values
reduced differently from their ``logp_reduction`` (a sum next to a mean is silently wrong).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grimoire.batching.budget import columns_of
from grimoire.errors import ConfigError, DataError
from grimoire.forward.logprobs import compute_token_logps
from grimoire.rows.kto import KTOCollator, mismatched_pair
from grimoire.rows.preference import PreferenceCollator

logger = logging.getLogger(__name__)

#: Every column this module may add (replaced when re-caching).
CACHE_COLUMNS: tuple[str, ...] = (
    "ref_chosen_logps",
    "ref_rejected_logps",
    "ref_logps",
    "ref_kl_logps",
    "kl_input_ids",
    "kl_attention_mask",
    "kl_labels",
    "ref_logps_reduction",
)


def _to_dataset(dataset: Any):
    from datasets import Dataset

    if isinstance(dataset, Dataset):
        return dataset
    from grimoire.rows.sources import rows_to_dataset

    return rows_to_dataset([dict(r) for r in dataset], source="cache_reference_log_probs")


def kl_pair_columns(rows: Sequence[Mapping[str, Any]], max_length: int | None) -> dict[str, list]:
    """KTO's dataset-level mismatched pairs: row ``i``'s prompt with row ``(i + 1) mod N``'s
    completion, as ``kl_input_ids``/``kl_attention_mask``/``kl_labels`` columns."""
    n = len(rows)
    pairs = [mismatched_pair(rows[i], rows[(i + 1) % n], max_length) for i in range(n)]
    return {
        "kl_input_ids": [p[0] for p in pairs],
        "kl_attention_mask": [[1] * len(p[0]) for p in pairs],
        "kl_labels": [p[1] for p in pairs],
    }


def with_kl_pairs(dataset: Any, max_length: int | None):
    """``dataset`` (as a ``datasets.Dataset``) with KTO's dataset-level KL pairs; rows that
    already carry ``kl_input_ids`` keep theirs."""
    ds = _to_dataset(dataset)
    if "kl_input_ids" in ds.column_names:
        return ds
    for name, values in kl_pair_columns([ds[i] for i in range(len(ds))], max_length).items():
        ds = ds.add_column(name, values)
    return ds


def _reduce(logps, reduction: str) -> torch.Tensor:
    return logps.sum() if reduction == "sum" else logps.mean()


@torch.no_grad()
def cache_reference_log_probs(
    ref_model: torch.nn.Module,
    dataset: Any,
    *,
    batch_size: int = 8,
    fused: bool = True,
    reduction: str = "sum",
    fused_chunk_size: int = 1024,
    autocast_dtype: torch.dtype | None = None,
    pad_token_id: int | None = None,
    max_length: int | None = None,
):
    """Return ``dataset`` (a ``datasets.Dataset``) with reference log-prob columns added.

    Args:
        ref_model: the frozen reference (usually the starting policy); run in eval mode on its
            current device.
        dataset: tokenized preference rows (``chosen_input_ids``...) or KTO rows
            (``input_ids``, ``labels``, ``label``); a ``Dataset`` or a list of dicts.
        batch_size: rows per reference forward.
        reduction: ``"sum"`` (DPO, KTO) or ``"mean"`` (IPO's default); must match the loss's
            ``logp_reduction``.
        autocast_dtype: run under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``
            when training with ``mixed_precision="bf16"``), so the cached values carry the same
            rounding as a live reference would.
        pad_token_id: padding id for batching (irrelevant to the result: padded positions are
            masked); default ``ref_model.config.pad_token_id`` or 0.
        max_length: KTO only: bound on a mismatched pair's length (use the training
            ``max_length``; the completion's end is cut).

    Preference rows get ``ref_chosen_logps``/``ref_rejected_logps``; KTO rows get ``ref_logps``,
    ``ref_kl_logps`` and the dataset-level pairs ``kl_*`` (see the module docstring). Both get
    ``ref_logps_reduction``.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    ds = _to_dataset(dataset)
    ds = ds.remove_columns([c for c in CACHE_COLUMNS if c in ds.column_names])
    cols = set(ds.column_names)
    if pad_token_id is None:
        pad_token_id = getattr(getattr(ref_model, "config", None), "pad_token_id", None) or 0
    device = next(ref_model.parameters()).device
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    was_training = ref_model.training
    ref_model.eval()

    def logps(batch: Mapping[str, Any], prefix: str) -> list[float]:
        with autocast:
            out = compute_token_logps(
                ref_model,
                batch[f"{prefix}input_ids"].to(device),
                batch[f"{prefix}labels"].to(device),
                attention_mask=batch[f"{prefix}attention_mask"].to(device),
                fused=fused,
                chunk_size=fused_chunk_size,
            )
        return _reduce(out, reduction).float().cpu().tolist()

    new: dict[str, list[Any]] = {}
    try:
        if {"chosen_input_ids", "rejected_input_ids"} <= cols:
            collate = PreferenceCollator(pad_token_id)
            new = {"ref_chosen_logps": [], "ref_rejected_logps": []}
            for start in range(0, len(ds), batch_size):
                batch = collate([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
                new["ref_chosen_logps"] += logps(batch, "chosen_")
                new["ref_rejected_logps"] += logps(batch, "rejected_")
        elif {"input_ids", "labels", "label"} <= cols:
            n = len(ds)
            rows = [ds[i] for i in range(n)]
            new = {**kl_pair_columns(rows, max_length), "ref_logps": [], "ref_kl_logps": []}
            collate = KTOCollator(pad_token_id)
            for start in range(0, n, batch_size):
                idx = range(start, min(start + batch_size, n))
                batch = collate(
                    [
                        {**rows[i], **{k: new[k][i] for k in ("kl_input_ids", "kl_labels")}}
                        for i in idx
                    ]
                )
                new["ref_logps"] += logps(batch, "")
                new["ref_kl_logps"] += logps(batch, "kl_")
        else:
            raise DataError(
                [
                    "cache_reference_log_probs: expected tokenized preference rows "
                    "(chosen_input_ids, rejected_input_ids, ...) or KTO rows (input_ids, labels, "
                    f"label); the dataset has {sorted(cols)}"
                ]
            )
    finally:
        ref_model.train(was_training)
    new["ref_logps_reduction"] = [reduction] * len(ds)
    for name, values in new.items():
        ds = ds.add_column(name, values)
    return ds


def check_precomputable(method: Any) -> None:
    """Raise a ConfigError unless ``method`` can score its reference before training."""
    name = type(method).__name__
    reference = getattr(method, "reference", None)
    if not getattr(method, "needs_reference_model", False):
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} uses no reference model: "
                "there is nothing to precompute; unset precompute_ref_log_probs"
            ]
        )
    if getattr(method, "needs_generation", False) or not getattr(reference, "cache_columns", ()):
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} is an online method: its "
                "completions are sampled during training, so their reference log-probs cannot "
                "be computed before it; unset precompute_ref_log_probs"
            ]
        )
    if not callable(getattr(method, "reference_logps", None)):
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} has no "
                "reference_logps(model, batch) returning its cached columns "
                f"{list(reference.cache_columns)}; add it, or unset precompute_ref_log_probs"
            ]
        )


@torch.no_grad()
def precompute_reference(
    method: Any,
    policy: torch.nn.Module,
    datasets: Sequence[Any],
    *,
    collator: Any,
    budget: Any,
    batch_size: int,
    accelerator: Any,
    move_policy: bool = True,
) -> list[Any]:
    """``TrainingConfig.precompute_ref_log_probs``: the datasets with the method's reference
    columns, from one no-grad pass of its :class:`~grimoire.forward.reference.Reference` (set up by the
    method's ``setup``), which is then released.

    The pass batches rows the way training does: the run's collator (padded or packed) and
    token budget (``max_tokens_per_device``, each row fitted as training will fit it), so no
    forward is larger than a training one and a cut row is cached as it will be trained. Each
    row's values come from the method's own ``reference_logps(model, batch)`` under the run's
    autocast, so they are what the live reference would return. KTO first fixes its KL pairs
    at dataset level (``cache_rows``). Every process computes every row: the values are then
    the same on all ranks without a collective, and under FSDP2 (a sharded reference: every
    forward is a collective) all ranks run the same forwards. ``move_policy``: move the policy to
    the accelerator's device first when it is the reference (not when it is sharded later).
    """
    from grimoire.batching.loader import StepLoader
    from grimoire.forward.reference import REDUCTION_COLUMN, is_quantized

    check_precomputable(method)
    reference = method.reference
    columns = tuple(reference.cache_columns)
    scorer = reference.ref_model
    if not isinstance(scorer, torch.nn.Module):  # the policy (adapters off, or untrained)
        scorer = policy
        if move_policy and not is_quantized(policy):
            policy.to(accelerator.device)  # where accelerate would put it next anyway
    device = next(scorer.parameters()).device
    out = []
    was_training = policy.training
    policy.eval()  # the policy may itself be the reference (adapters disabled, or untrained)
    try:
        for split, dataset in zip(("train", "eval"), datasets):
            if dataset is None or all(c in columns_of(dataset) for c in columns):
                out.append(dataset)  # already cached (e.g. cache_reference_log_probs)
                continue
            ds = _to_dataset(dataset)
            ds = ds.remove_columns(
                [c for c in (*columns, REDUCTION_COLUMN) if c in ds.column_names]
            )
            ds = getattr(method, "cache_rows", lambda d: d)(ds)
            if budget is not None and (problems := budget.problems(ds, split)):
                raise DataError(problems, title="precompute_ref_log_probs: rows over the budget")
            loader = StepLoader.build(
                ds, collator, budget, batch_size=batch_size, world_size=1, rank=0, shuffle=False
            )
            values = torch.full((len(ds), len(columns)), float("nan"), dtype=torch.float64)
            for step in range(loader.steps_per_epoch):
                for indices in loader.planner.plan(0, step):
                    if not indices:
                        continue
                    batch, _ = loader.collate(indices, True)
                    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    with accelerator.autocast():
                        got = method.reference_logps(policy, batch)
                    values[indices] = torch.stack([g.double().cpu() for g in got], dim=1)
            missing = int(values.isnan().any(dim=1).sum())
            if missing:  # a planner bug, never a data property: fail loudly, not train on NaN
                raise RuntimeError(f"precompute_ref_log_probs: {missing} {split} rows not scored")
            for j, name in enumerate(columns):
                ds = ds.add_column(name, values[:, j].tolist())
            out.append(ds.add_column(REDUCTION_COLUMN, [method.logp_reduction] * len(ds)))
    finally:
        policy.train(was_training)
    logger.info("%s: reference log-probs precomputed; reference released", type(method).__name__)
    reference.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


__all__ = [
    "CACHE_COLUMNS",
    "cache_reference_log_probs",
    "check_precomputable",
    "kl_pair_columns",
    "precompute_reference",
    "with_kl_pairs",
]
