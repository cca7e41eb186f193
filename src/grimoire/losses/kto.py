"""KTO: ``KTOLoss`` on unpaired desirable / undesirable examples.

Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv 2402.01306.
Math: :func:`grimoire.losses.functional.kto_loss` and
:func:`~grimoire.losses.functional.kto_kl_estimate`.

Per micro-batch: one policy forward WITH gradient over the rows' own completions, one policy
forward WITHOUT gradient over the mismatched KL pairs (``kl_*`` columns from the
:class:`~grimoire.collate.kto.KTOCollator`; the estimate is detached anyway, so storing its
activations would waste memory), and one reference forward over both (skipped when the batch
carries cached ``ref_logps``/``ref_kl_logps``).

Padding-free (``TrainingConfig.padding_free`` / ``max_tokens_per_device``): the
:class:`~grimoire.collate.kto.PackedKTOCollator` packs the completions then their KL pairs into one
row; :func:`kto_parts` cuts it into the two groups and every forward's result is unpacked back to
padded rows (:mod:`grimoire.forward.batch`), so the loss math is shared by both layouts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import default_budget_tokens, truncate_sequences
from grimoire.collate.kto import KTO_SIDES, KTOCollator, PackedKTOCollator
from grimoire.columns import column_values, columns_of
from grimoire.errors import ConfigError
from grimoire.forward.batch import LayoutRows, rows_per_side, side_rows, sides_token_logps
from grimoire.forward.logprobs import TokenLogps
from grimoire.forward.precomputed import with_kl_pairs
from grimoire.forward.reference import Reference
from grimoire.losses.checks import _check_beta, _check_weight
from grimoire.losses.kto_functional import kto_kl_estimate, kto_loss
from grimoire.losses.preference import (
    ReferenceLoss,
    check_reduction,
    policy_compute,
    reduce_logps,
    with_peer_names,
)
from grimoire.rows.kto import KTO_COLUMNS, PEER_LABEL_COLUMN, label_column

logger = logging.getLogger(__name__)

REF_KTO_COLUMNS: tuple[str, str] = ("ref_logps", "ref_kl_logps")
#: The paper's recommended range for ``w_d * n_d / (w_u * n_u)``.
RECOMMENDED_RATIO: tuple[float, float] = (1.0, 4.0 / 3.0)


def cross_rank_mean(count: int, ctx: Any) -> Callable[[Tensor], Tensor] | None:
    """``reduce_fn`` for :func:`kto_kl_estimate`: the mean over ALL ranks' mismatched pairs.

    An all-reduce of ``(sum, count)`` rather than a mean of rank means, so ranks with different
    batch sizes are weighted by their pairs; it goes through the run's
    :class:`~grimoire.config.context.TrainingContext` (``ctx``), the methods' only collectives.
    None on one process, or without a context (the loss called outside a run).
    """
    if ctx is None or ctx.num_processes == 1:
        return None

    def reduce(local_mean: Tensor) -> Tensor:
        packed = torch.stack(
            [local_mean.float() * count, torch.tensor(float(count), device=local_mean.device)]
        )
        packed = ctx.all_reduce_sum_tensor(packed)
        return packed[0] / packed[1].clamp(min=1)

    return reduce


def num_rows(batch: dict[str, Any]) -> int:
    """The micro-batch's KTO rows (a packed batch holds 2 samples per row: its own + KL pair)."""
    return rows_per_side(batch, KTO_SIDES)


def kto_parts(batch: dict[str, Any]) -> tuple[LayoutRows, LayoutRows]:
    """The rows' own completions and their mismatched KL pairs, padded or packed.

    A packed batch (:class:`~grimoire.collate.kto.PackedKTOCollator`) holds the own samples first,
    so it is cut after them into two packed rows (:func:`grimoire.forward.batch.side_rows`): the
    policy can then run WITH gradient over the first and without over the second, as in the
    padded layout.
    """
    own, kl_rows = side_rows(batch, KTO_SIDES)
    return own, kl_rows


def joint_logps(
    batch: dict[str, Any], compute: Callable[..., TokenLogps]
) -> tuple[TokenLogps, TokenLogps]:
    """Own and KL per-token log-probs from ONE forward over both groups (the reference pass)."""
    own, kl = sides_token_logps(compute, batch, KTO_SIDES)
    return own, kl


def _label_counts(dataset: Any) -> tuple[int, int]:
    labels = column_values(dataset, label_column(columns_of(dataset)))
    desirable = sum(bool(x) for x in labels)
    return desirable, len(labels) - desirable


class KTOLoss(ReferenceLoss):
    """KTO loss, mean over the micro-batch's rows (``loss_weight`` = rows).

    Args:
        beta: reward scale (> 0).
        ref_model: frozen reference; optional with a LoRA policy or cached ``ref_logps`` /
            ``ref_kl_logps`` columns (see :class:`grimoire.forward.reference.Reference`).
        desirable_weight, undesirable_weight: class weights ``w_d``, ``w_u``; the paper
            recommends ``w_d * n_d / (w_u * n_u)`` in ``[1, 4/3]`` (checked on the train set).
        logp_reduction: ``"sum"`` (paper and TRL) or ``"mean"``.

    The KL reference point ``z0`` is the mean over the mismatched pairs of
    ``log pi - log pi_ref``, averaged over all ranks (an all-reduce through the run's context
    when training on several processes), clamped at 0 and detached.

    Metrics: ``rewards/chosen`` and ``rewards/rejected`` (mean ``beta * (log pi - log pi_ref)``
    over the micro-batch's desirable / undesirable rows, 0 when it has none), ``rewards/margins``
    (their difference), ``logps/chosen``, ``logps/rejected`` (policy, same convention), ``kl``,
    and TRL's exactly-aggregatable sums and counts (``rewards/chosen_sum``, ``count/chosen``, ...).
    """

    required_columns = KTO_COLUMNS

    def __init__(
        self,
        beta: float = 0.1,
        ref_model: torch.nn.Module | None = None,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        logp_reduction: str = "sum",
        fused: bool = True,
        fused_chunk_size: int = 1024,
        lambda_d: float | None = None,
        lambda_u: float | None = None,
    ):
        # grimoire-rl's (and the paper's) names for the two weights.
        for alias, name, default in (
            (lambda_d, "desirable_weight", desirable_weight),
            (lambda_u, "undesirable_weight", undesirable_weight),
        ):
            if alias is not None and default != 1.0:
                raise ValueError(f"KTOLoss: give {name} or its alias, not both")
        desirable_weight = desirable_weight if lambda_d is None else lambda_d
        undesirable_weight = undesirable_weight if lambda_u is None else lambda_u
        _check_beta(beta)
        _check_weight(desirable_weight, "desirable_weight")
        _check_weight(undesirable_weight, "undesirable_weight")
        super().__init__(fused=fused, fused_chunk_size=fused_chunk_size)
        self.beta = beta
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight
        self.logp_reduction = check_reduction(logp_reduction, "KTOLoss")
        self.reference = Reference(ref_model, "KTOLoss", REF_KTO_COLUMNS)
        #: KL pairs are cut to the run's max_length (set in setup; None: not cut).
        self._kl_max_length: int | None = None
        #: The run's context (set in setup): the KL estimate's cross-rank mean goes through it.
        self._ctx: Any = None

    # ------------------------------------------------------------------ hooks

    def create_collator(self, pad_token_id: int) -> KTOCollator:
        return KTOCollator(pad_token_id=pad_token_id, max_length=self._kl_max_length)

    def create_packed_collator(self, pad_token_id: int) -> PackedKTOCollator:
        return PackedKTOCollator(pad_token_id=pad_token_id, max_length=self._kl_max_length)

    def loss_weight(self, batch: dict[str, Any]) -> float:
        return float(num_rows(batch))

    #: Appended to a budget error: the row's cost includes the KL row the collator adds.
    budget_hint = ", plus its mismatched KL row of about the same length"

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """A row and its mismatched KL row: in-batch pairs join prompt ``i`` with completion
        ``i + 1``, a permutation, so a micro-batch's KL rows hold as many tokens as its own rows
        (or fewer, cut to max_length): twice the row. Cached ``kl_input_ids`` count as they are."""
        if "kl_" in lengths:
            return default_budget_tokens(lengths, packed)
        return 2 * lengths[""]

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        """Cut the row (and a cached KL row) so the pair of them fits."""
        return truncate_sequences(row, budget if "kl_input_ids" in row else budget // 2)

    def setup(self, ctx: Any) -> None:
        super().setup(ctx)
        self._ctx = ctx
        self._kl_max_length = ctx.config.max_length  # bounds the mismatched pairs too
        cols = set(columns_of(ctx.train_dataset))
        if ctx.config.batch_size < 2 and "kl_input_ids" not in cols:
            raise ConfigError(
                [
                    "KTOLoss needs batch_size >= 2: the KL reference point pairs each prompt with "
                    "ANOTHER row's completion in the batch (with one row it would be the row's own "
                    "completion); raise batch_size, or fix the pairs at dataset level with "
                    "grimoire.forward.precomputed.cache_reference_log_probs"
                ]
            )

    def _missing_columns(self, names: set[str]) -> list[str]:
        # Rows tokenized by grimoire-rl hold the label as kto_label; the collators read it.
        if label_column(names) == PEER_LABEL_COLUMN:
            names = names | {"label"}
        return super()._missing_columns(names)

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        """Missing columns, and a dataset holding only one class (KTO needs both)."""
        problems = super().validate_dataset(dataset, split)
        if problems or not len(dataset):
            return problems
        n_d, n_u = _label_counts(dataset)
        if n_d == 0 or n_u == 0:
            problems.append(
                f"{split} dataset: KTO needs both desirable and undesirable rows but 'label' has "
                f"{n_d} desirable (True) and {n_u} undesirable (False); with one class the loss "
                "only pushes that class against the moving KL reference point (use SFT for "
                "desirable-only data)"
            )
        elif split == "train":
            ratio = (self.desirable_weight * n_d) / max(self.undesirable_weight * n_u, 1e-12)
            lo, hi = RECOMMENDED_RATIO
            if not lo <= ratio <= hi:
                logger.warning(
                    "KTO: desirable_weight * n_desirable / (undesirable_weight * n_undesirable) "
                    "= %.3g * %d / (%.3g * %d) = %.3g is outside the paper's recommended [1, 4/3];"
                    " consider adjusting desirable_weight / undesirable_weight",
                    self.desirable_weight,
                    n_d,
                    self.undesirable_weight,
                    n_u,
                    ratio,
                )
        return problems

    def cache_rows(self, dataset: Any) -> Any:
        """The rows as a reference cache holds them: with their KL pairs fixed at dataset level
        (in-batch pairs depend on how rows are batched, so no per-row cache can hold them)."""
        return with_kl_pairs(dataset, self._kl_max_length)

    def reference_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """``[B]`` reference log-probs of the rows and of their KL pairs, in
        :data:`REF_KTO_COLUMNS` order: cached, or ONE no-grad forward over both groups."""
        cached = self.frozen_reference.cached(batch, self.logp_reduction)
        if cached is not None:
            return cached[0], cached[1]
        ref_fn = self.frozen_reference.compute(
            model, fused=self.fused, chunk_size=self.fused_chunk_size
        )
        ref_t, ref_kl_t = joint_logps(batch, ref_fn)
        return reduce_logps(ref_t, self.logp_reduction), reduce_logps(ref_kl_t, self.logp_reduction)

    # ------------------------------------------------------------------ loss

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Tensor]]:
        own, kl_rows = kto_parts(batch)
        red = self.logp_reduction
        policy_fn = policy_compute(model, fused=self.fused, chunk_size=self.fused_chunk_size)
        policy = reduce_logps(own.token_logps(policy_fn), red)
        with torch.no_grad():
            policy_kl = reduce_logps(kl_rows.token_logps(policy_fn), red)
        ref, ref_kl = (t.to(policy.device) for t in self.reference_logps(model, batch))
        kl = kto_kl_estimate(
            policy_kl, ref_kl, reduce_fn=cross_rank_mean(policy_kl.shape[0], self._ctx)
        )
        losses, sums = kto_loss(
            policy,
            ref,
            batch["label"].to(policy.device).bool(),
            kl,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        n_c, n_r = sums["count/chosen"], sums["count/rejected"]
        metrics = {
            "rewards/chosen": sums["rewards/chosen_sum"] / n_c.clamp(min=1),
            "rewards/rejected": sums["rewards/rejected_sum"] / n_r.clamp(min=1),
            "logps/chosen": sums["logps/chosen_sum"] / n_c.clamp(min=1),
            "logps/rejected": sums["logps/rejected_sum"] / n_r.clamp(min=1),
        }
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        metrics.update(sums)
        # grimoire-rl's reward_accuracy: a desirable row is right when its reward is > 0, an
        # undesirable one when it is < 0 (TRL's KTO logs no accuracy).
        desirable = batch["label"].to(policy.device).bool()
        right = torch.where(desirable, policy > ref, policy < ref)
        metrics["rewards/accuracies"] = right.float().mean()
        metrics = with_peer_names(metrics)
        return losses.mean(), {k: v.detach() for k, v in metrics.items()}


__all__ = [
    "REF_KTO_COLUMNS",
    "KTOLoss",
    "cross_rank_mean",
    "joint_logps",
    "kto_parts",
    "num_rows",
]
