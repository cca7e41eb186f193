"""Rows -> planner -> collator: the micro-batches of each optimizer step, on CPU.

:class:`StepLoader` joins the stages that precede the model: the planner (which rows each rank
trains on at each step, within the token budget if one is set), the budget's row fitting, and the
method's collator. It yields, per step, this rank's micro-batches as ``(batch, keep)`` pairs
(``keep = 0.0`` marks a rank-sync dummy). Batches stay on CPU here: DataLoader workers only
collate, and the trainer moves tensors to the device in the main process (a worker that touched
CUDA would fail).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from grimoire.batching.budget import TokenBudget, padding_ratio
from grimoire.batching.steps import StepPlanner
from grimoire.config.training import TrainingConfig
from grimoire.contract.method import Collator, Method
from grimoire.errors import ConfigError


class StepLoader:
    """Per-step micro-batches of ``dataset`` for one rank.

    Args:
        dataset: rows (``datasets.Dataset`` or a list of dicts).
        collator: the method's collator (padded or packed).
        planner: the :class:`StepPlanner` for this rank.
        budget: the run's :class:`TokenBudget`, or None.
    """

    def __init__(
        self, dataset: Any, collator: Collator, planner: StepPlanner, budget: TokenBudget | None
    ):
        self.dataset, self.collator, self.planner, self.budget = dataset, collator, planner, budget

    @classmethod
    def build(
        cls,
        dataset: Any,
        collator: Collator,
        budget: TokenBudget | None,
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        **planner_kwargs: Any,
    ) -> StepLoader:
        planner = StepPlanner(
            num_samples=len(dataset),
            batch_size=batch_size,
            world_size=world_size,
            rank=rank,
            lengths=budget.costs(dataset) if budget else None,
            max_tokens_per_device=budget.row_tokens if budget else None,
            padded=bool(budget and not budget.packed),
            **planner_kwargs,
        )
        return cls(dataset, collator, planner, budget)

    @property
    def steps_per_epoch(self) -> int:
        return self.planner.steps_per_epoch

    def collate(self, indices: list[int], real: bool) -> tuple[dict[str, Any], float]:
        """One micro-batch and its keep flag (0.0 for a dummy)."""
        rows = [self.dataset[int(i)] for i in indices]
        if self.budget is not None:
            rows = [self.budget.fit(r) for r in rows]
        return self.collator(rows), 1.0 if real else 0.0

    def step(self, epoch: int, step: int) -> list[tuple[dict[str, Any], float]]:
        """The micro-batches of ``(epoch, step)``; a dummy reruns one real row with keep 0."""
        plan = self.planner.plan(epoch, step)
        fallback = next((m for m in plan if m), None) or [
            int(self.planner.step_indices(epoch, 0)[0])
        ]
        return [self.collate(m or fallback[:1], bool(m)) for m in plan]

    def epoch(
        self, epoch: int, start_step: int, num_workers: int = 0
    ) -> Iterator[list[tuple[dict[str, Any], float]]]:
        """Each remaining step of ``epoch``, optionally collated ahead by DataLoader workers."""
        steps = _Steps(self, epoch, start_step)
        if num_workers == 0:
            yield from (steps[i] for i in range(len(steps)))
            return
        yield from torch.utils.data.DataLoader(
            steps, batch_size=None, num_workers=num_workers, collate_fn=_identity
        )

    def all_batches(self) -> Iterator[tuple[dict[str, Any], float]]:
        """Every micro-batch of one unshuffled pass (evaluation)."""
        for step in range(self.steps_per_epoch):
            yield from self.step(0, step)


#: Attention implementations that keep the samples of a packed row apart (transformers detects
#: the restarting position_ids; flash-attention reads them as varlen boundaries).
PACKING_ATTENTION = (
    "sdpa",
    "eager",
    "flash_attention_2",
    "flash_attention_3",
    "grimoire_packed_sdpa",
)


#: ``padding_free=None`` packs offline methods only when padding would add at least this share of
#: positions: on rows of nearly equal length the packed path's per-sample work costs more than
#: the padding it saves (measured on the quickstart: padded ~1.3x faster at a ratio of ~1.1).
AUTO_PACKING_MIN_RATIO = 1.25
#: Why ``padding_free=None`` does not pack on a CUDA GPU where packed rows would not take a
#: varlen kernel: the one GPU measurement (an H200, SFT on long-tailed rows; docs/performance.md,
#: "On a GPU") had the per-sample packed path 6.6x slower than padded. Packing stays one switch
#: away, and exact.
AUTO_PACKING_CUDA_NOTE = (
    "auto: on a CUDA GPU without a varlen kernel packed rows attend per sample, measured 6.6x "
    "slower than padded (docs/performance.md, 'On a GPU'); set padding_free=True to pack anyway"
)


def packing_decision(
    method: Method,
    config: TrainingConfig,
    pad_id: int,
    given: Any = None,
    model: Any = None,
    dataset: Any = None,
    device_type: str = "cpu",
    cuda_varlen: str | None = None,
) -> tuple[bool, str]:
    """Whether micro-batches are packed rows, and why (logged at start).

    Packed whenever ``padding_free`` or a token budget is asked for and the method can pack. With
    ``padding_free=None`` (the default, "auto") also packed when the method can pack, ``model``
    is a transformers model whose attention keeps packed samples apart, and (offline methods,
    given ``dataset``) padding would add at least :data:`AUTO_PACKING_MIN_RATIO` - 1 of the
    positions (:func:`~grimoire.batching.budget.padding_ratio`): the loss is the same as padded (the
    parity tests), with less work on rows of different lengths. A budget with a
    method that cannot pack (reward modelling) bins padded micro-batches instead. A user's
    ``data_collator`` counts as padded unless it has ``packed = True``. On a CUDA device
    (``device_type``) auto packs only where packed rows take a varlen kernel: ``cuda_varlen``
    says which and why (``"varlen: ..."`` / ``"flash_attn: ..."``) or why not (then padded, see
    :data:`AUTO_PACKING_CUDA_NOTE`); that kernel is unmeasured on a GPU (docs/performance.md).
    """
    if given is not None:
        packed = bool(getattr(given, "packed", False))
        return packed, "the data_collator given to the trainer"
    can_pack = method.create_packed_collator(pad_id) is not None
    asked = bool(config.padding_free or config.max_tokens_per_device)
    if config.padding_free is None and not asked:
        if not can_pack:
            return False, f"{method.method_name} has no packed collator"
        return _auto_packing(method, config, model, dataset, device_type, cuda_varlen)
    if not asked:
        return False, "padding_free=False"
    if can_pack:
        return True, "padding_free / max_tokens_per_device"
    if config.padding_free:
        raise ConfigError(
            [
                f"{method.method_name} does not support padding-free batches: unset "
                "training.padding_free (training.max_tokens_per_device alone still bounds "
                "its padded micro-batches)"
            ]
        )
    return False, f"{method.method_name} cannot pack: padded micro-batches within the budget"


def _auto_packing(
    method: Method,
    config: TrainingConfig,
    model: Any,
    dataset: Any,
    device_type: str,
    cuda_varlen: str | None,
) -> tuple[bool, str]:
    """``padding_free=None`` for a method that can pack: whether the model's attention, the
    device's kernels and (offline methods) the data's padding make packing pay."""
    reason = _attention_cannot_pack(model)
    if reason is not None:
        return False, reason
    gpu = ""
    if device_type == "cuda":
        if cuda_varlen is None:  # (not probed: the caller did not say)
            return False, AUTO_PACKING_CUDA_NOTE
        if not cuda_varlen.startswith(("varlen:", "flash_attn:")):
            return False, f"{AUTO_PACKING_CUDA_NOTE} ({cuda_varlen})"
        gpu = f"; on CUDA packed rows take {cuda_varlen} (unmeasured on a GPU)"
    if dataset is not None and not method.needs_generation:
        # (Online methods pack their sampled completions, whose lengths the prompts do not
        # tell: they always pack.)
        ratio = padding_ratio(dataset, config.batch_size, config.seed)
        if ratio < AUTO_PACKING_MIN_RATIO:
            return False, (
                f"auto: padding would add only {ratio - 1:.0%} positions on this data "
                f"(packing pays from {AUTO_PACKING_MIN_RATIO - 1:.0%})"
            )
        return True, f"auto: padding would add {ratio - 1:.0%} positions on this data{gpu}"
    return True, f"auto: the method packs and the model's attention keeps samples apart{gpu}"


def _attention_cannot_pack(model: Any) -> str | None:
    """Why ``model`` is not known to keep packed samples apart (None: it is)."""
    if model is None:
        return "no model to check"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not type(base).__module__.startswith("transformers."):
        return f"{type(base).__name__} is not a transformers model (its attention is unknown)"
    impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return f"attention implementation {impl!r} is not known to isolate packed samples"
    return None


def _identity(x: Any) -> Any:
    return x


class _Steps(torch.utils.data.Dataset):
    """Map-style view of one epoch's remaining steps, so a DataLoader can prefetch them."""

    def __init__(self, loader: StepLoader, epoch: int, start_step: int):
        self.loader, self.epoch, self.start = loader, epoch, start_step

    def __len__(self) -> int:
        return max(0, self.loader.steps_per_epoch - self.start)

    def __getitem__(self, i: int) -> list[tuple[dict[str, Any], float]]:
        return self.loader.step(self.epoch, self.start + i)


__all__ = [
    "AUTO_PACKING_MIN_RATIO",
    "PACKING_ATTENTION",
    "StepLoader",
    "packing_decision",
]
