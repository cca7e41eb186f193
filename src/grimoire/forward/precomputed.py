"""Precompute a frozen reference model's log-probs once, so training needs no reference forward.

Two callers, one pass (:func:`score_reference_columns`, which batches rows, scores them without
gradients in eval mode, and writes the columns plus the ``ref_logps_reduction`` column):

* :func:`cache_reference_log_probs` (public, ``grimoire.data``): an explicit reference model
  over tokenized preference or KTO rows, in fixed-size batches; adds the columns DPO/IPO
  (``ref_chosen_logps``, ``ref_rejected_logps``) and KTO (``ref_logps``, ``ref_kl_logps``) read
  instead of running a reference model: the reference costs one pass over the data instead of
  one forward per step, and need not be in memory while training.
* :func:`precompute_reference` (``TrainingConfig.precompute_ref_log_probs``, run by the
  trainer): the method's own :class:`~grimoire.forward.reference.Reference`, batched as training
  batches, then released.

KTO: its KL term uses mismatched pairs. In-batch pairs depend on how rows are batched, so they
cannot be cached; here the pairs are fixed at dataset level instead (row ``i``'s prompt with row
``(i + 1) mod N``'s completion) and written as ``kl_input_ids``/``kl_attention_mask``/
``kl_labels`` next to ``ref_kl_logps``; the ``KTOCollator`` then uses those pairs. Rows sharing a
prompt should not be adjacent (shuffle the dataset first), or their "mismatched" pair is not.

The ``ref_logps_reduction`` column records the reduction, and the losses refuse cached values
reduced differently from their ``logp_reduction`` (a sum next to a mean is silently wrong).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor

from grimoire.batching.budget import TokenBudget
from grimoire.batching.loader import StepLoader
from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.columns import columns_of, pad_token_id_of
from grimoire.contract.method import Collator, Method, MethodReference, PrecomputableMethod
from grimoire.errors import ConfigError, DataError
from grimoire.forward.logprobs import compute_token_logps
from grimoire.forward.reference import REDUCTION_COLUMN, eval_mode, is_quantized
from grimoire.rows.kto import label_column, mismatched_pair
from grimoire.rows.sources import rows_to_dataset

logger = logging.getLogger(__name__)

#: The reference columns of each row kind, by the sequence prefix each is scored on.
PAIR_COLUMNS: dict[str, str] = {"chosen_": "ref_chosen_logps", "rejected_": "ref_rejected_logps"}
KTO_COLUMNS: dict[str, str] = {"": "ref_logps", "kl_": "ref_kl_logps"}
#: KTO's dataset-level mismatched pairs (see the module docstring).
KL_PAIR_COLUMNS: tuple[str, ...] = ("kl_input_ids", "kl_attention_mask", "kl_labels")

#: Every column this module may add (replaced when re-caching).
CACHE_COLUMNS: tuple[str, ...] = (
    *PAIR_COLUMNS.values(),
    *KTO_COLUMNS.values(),
    *KL_PAIR_COLUMNS,
    REDUCTION_COLUMN,
)


class Progress(Protocol):
    """What a pass reports its rows to (``grimoire.training.phases.Phase``)."""

    def advance(self, n: int) -> None: ...


#: ``(split, rows) -> a context`` around one split's pass, giving its :class:`Progress`: how a
#: caller shows a long reference pass (start, rows done, end) without this module printing.
ProgressFactory = Callable[[str, int], AbstractContextManager[Progress]]


def _to_dataset(dataset: Any):
    from datasets import Dataset  # heavy to import: only when caching

    if isinstance(dataset, Dataset):
        return dataset
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


@torch.no_grad()
def score_reference_columns(
    ds: Any,
    columns: Sequence[str],
    reduction: str,
    *,
    model: torch.nn.Module,
    batches: Iterable[Sequence[int]],
    collate: Callable[[Sequence[int]], dict[str, Any]],
    score: Callable[[dict[str, Any]], Sequence[Tensor]],
    device: torch.device,
    split: str = "train",
    progress: Progress | None = None,
) -> Any:
    """The one reference pass: ``ds`` (a ``datasets.Dataset``) with ``columns`` and the
    reduction column added.

    ``batches`` lists the row indices of each forward (every row exactly once);
    ``collate(indices)`` builds their batch, moved to ``device``; ``score(batch)`` returns one
    ``[rows]`` tensor per column, in ``columns`` order. ``model`` (the module whose forward
    scores, or the policy wrapping it) is in eval mode for the pass, then back as it was.
    ``progress`` is told the rows each batch scored.
    """
    values = torch.full((len(ds), len(columns)), float("nan"), dtype=torch.float64)
    with eval_mode(model):
        for indices in batches:
            if not indices:
                continue
            indices = list(indices)
            batch = collate(indices)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            got = score(batch)
            values[indices] = torch.stack([g.double().cpu() for g in got], dim=1)
            if progress is not None:
                progress.advance(len(indices))
    missing = int(values.isnan().any(dim=1).sum())
    if missing:  # a batching bug, never a data property: fail loudly, not train on NaN
        raise RuntimeError(f"reference log-probs: {missing} {split} rows not scored")
    for j, name in enumerate(columns):
        ds = ds.add_column(name, values[:, j].tolist())
    return ds.add_column(REDUCTION_COLUMN, [reduction] * len(ds))


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
    progress: ProgressFactory | None = None,
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
            masked); default :func:`grimoire.columns.pad_token_id_of` of ``ref_model``.
        max_length: KTO only: bound on a mismatched pair's length (use the training
            ``max_length``; the completion's end is cut).
        progress: ``(split, rows) -> context`` around the pass, told the rows each batch
            scored (the CLI's phase lines); None: silent.

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
    if pad_token_id is None:
        pad_token_id = pad_token_id_of(model=ref_model)
    ds, sides, collator = _row_kind(ds, pad_token_id, max_length)
    device = next(ref_model.parameters()).device
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )

    def score(batch: Mapping[str, Any]) -> list[Tensor]:
        out = []
        for prefix in sides:
            with autocast:
                logps = compute_token_logps(
                    ref_model,
                    batch[f"{prefix}input_ids"],
                    batch[f"{prefix}labels"],
                    attention_mask=batch[f"{prefix}attention_mask"],
                    fused=fused,
                    chunk_size=fused_chunk_size,
                )
            out.append(logps.sum() if reduction == "sum" else logps.mean())
        return out

    with _reporting(progress, "train", len(ds)) as rows:
        return score_reference_columns(
            ds,
            tuple(sides.values()),
            reduction,
            model=ref_model,
            batches=[range(s, min(s + batch_size, len(ds))) for s in range(0, len(ds), batch_size)],
            collate=lambda indices: collator([ds[i] for i in indices]),
            score=score,
            device=device,
            progress=rows,
        )


def _reporting(
    progress: ProgressFactory | None, split: str, rows: int
) -> AbstractContextManager[Progress | None]:
    return progress(split, rows) if progress is not None else contextlib.nullcontext()


def _row_kind(
    ds: Any, pad_token_id: int, max_length: int | None
) -> tuple[Any, dict[str, str], Collator]:
    """``(ds, the reference columns by sequence prefix, the collator)`` of preference or KTO
    rows (KTO's get their dataset-level KL pairs first), else a DataError."""
    cols = set(ds.column_names)
    if {"chosen_input_ids", "rejected_input_ids"} <= cols:
        return ds, PAIR_COLUMNS, PreferenceCollator(pad_token_id)
    if {"input_ids", "labels", label_column(cols)} <= cols:
        # The KTOCollator keeps a row's own pair.
        return with_kl_pairs(ds, max_length), KTO_COLUMNS, KTOCollator(pad_token_id)
    raise DataError(
        [
            "cache_reference_log_probs: expected tokenized preference rows "
            "(chosen_input_ids, rejected_input_ids, ...) or KTO rows (input_ids, labels, "
            f"label); the dataset has {sorted(cols)}"
        ]
    )


def check_precomputable(method: Method) -> None:
    """Raise a ConfigError unless ``method`` can score its reference before training."""
    _precomputable(method)


def _precomputable(method: Method) -> tuple[PrecomputableMethod, MethodReference]:
    """``method`` and its reference when it can score that reference before training, else a
    ConfigError saying why not."""
    name = method.method_name
    if not method.needs_reference_model:
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} uses no reference model: "
                "there is nothing to precompute; unset precompute_ref_log_probs"
            ]
        )
    reference = method.reference
    if method.needs_generation or reference is None or not reference.cache_columns:
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} is an online method: its "
                "completions are sampled during training, so their reference log-probs cannot "
                "be computed before it; unset precompute_ref_log_probs"
            ]
        )
    if not isinstance(method, PrecomputableMethod):
        raise ConfigError(
            [
                f"training.precompute_ref_log_probs=true but {name} has no "
                "reference_logps(model, batch) returning its cached columns "
                f"{list(reference.cache_columns)}; add it, or unset "
                "precompute_ref_log_probs"
            ]
        )
    return method, reference


def precompute_reference(
    method: Method,
    policy: torch.nn.Module,
    datasets: Sequence[Any],
    *,
    collator: Collator,
    budget: TokenBudget | None,
    batch_size: int,
    accelerator: Any,
    move_policy: bool = True,
    progress: ProgressFactory | None = None,
) -> list[Any]:
    """``TrainingConfig.precompute_ref_log_probs``: the datasets with the method's reference
    columns, from one no-grad pass of its :class:`~grimoire.forward.reference.Reference` (set up
    by the method's ``setup``), which is then released.

    The pass batches rows the way training does: the run's collator (padded or packed) and
    token budget (``max_tokens_per_device``, each row fitted as training will fit it), so no
    forward is larger than a training one and a cut row is cached as it will be trained. Each
    row's values come from the method's own ``reference_logps(model, batch)`` under the run's
    autocast, so they are what the live reference would return. KTO first fixes its KL pairs
    at dataset level (``cache_rows``). Every process computes every row: the values are then
    the same on all ranks without a collective, and under FSDP2 (a sharded reference: every
    forward is a collective) all ranks run the same forwards. ``move_policy``: move the policy
    to the accelerator's device first when it is the reference (not when it is sharded later).
    ``progress``: as :func:`cache_reference_log_probs`', once per split.
    """
    scoring, reference = _precomputable(method)
    columns = tuple(reference.cache_columns)
    device = _scoring_device(reference, policy, accelerator.device, move_policy)

    def score(batch: dict[str, Any]) -> Sequence[Tensor]:
        with accelerator.autocast():
            return scoring.reference_logps(policy, batch)

    out = [
        _precompute_split(
            scoring,
            dataset,
            split,
            columns,
            policy,
            collator,
            budget,
            batch_size,
            score,
            device,
            progress,
        )
        for split, dataset in zip(("train", "eval"), datasets)
    ]
    logger.info("%s: reference log-probs precomputed; reference released", method.method_name)
    reference.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _scoring_device(
    reference: MethodReference, policy: torch.nn.Module, target: torch.device, move_policy: bool
) -> torch.device:
    """Where the reference forward runs: its own model's device, or the policy's (adapters off,
    or untrained), moved to ``target`` first when ``move_policy``."""
    scorer = reference.ref_model
    if not isinstance(scorer, torch.nn.Module):  # the policy (adapters off, or untrained)
        scorer = policy
        if move_policy and not is_quantized(policy):
            policy.to(target)  # where accelerate would put it next anyway
    return next(scorer.parameters()).device


def _precompute_split(
    method: PrecomputableMethod,
    dataset: Any,
    split: str,
    columns: tuple[str, ...],
    policy: torch.nn.Module,
    collator: Collator,
    budget: TokenBudget | None,
    batch_size: int,
    score: Callable[[dict[str, Any]], Sequence[Tensor]],
    device: torch.device,
    progress: ProgressFactory | None = None,
) -> Any:
    """One split with the method's reference columns (as it is when it has them already, e.g.
    from ``cache_reference_log_probs``), batched as training batches it."""
    if dataset is None or all(c in columns_of(dataset) for c in columns):
        return dataset
    ds = _to_dataset(dataset)
    ds = ds.remove_columns([c for c in (*columns, REDUCTION_COLUMN) if c in ds.column_names])
    ds = method.cache_rows(ds)
    if budget is not None and (problems := budget.problems(ds, split)):
        raise DataError(problems, title="precompute_ref_log_probs: rows over the budget")
    loader = StepLoader.build(
        ds, collator, budget, batch_size=batch_size, world_size=1, rank=0, shuffle=False
    )
    batches = (
        indices
        for step in range(loader.steps_per_epoch)
        for indices in loader.planner.plan(0, step)
    )
    # The policy goes to eval mode whichever module scores: it may itself be the reference
    # (adapters disabled, or untrained).
    with _reporting(progress, split, len(ds)) as rows:
        return score_reference_columns(
            ds,
            columns,
            method.logp_reduction,
            model=policy,
            batches=batches,
            collate=lambda indices: loader.collate(list(indices), True)[0],
            score=score,
            device=device,
            split=split,
            progress=rows,
        )


__all__ = [
    "CACHE_COLUMNS",
    "Progress",
    "ProgressFactory",
    "cache_reference_log_probs",
    "check_precomputable",
    "kl_pair_columns",
    "precompute_reference",
    "score_reference_columns",
    "with_kl_pairs",
]
