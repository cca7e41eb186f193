"""The token budget: what one row costs in a forward pass, and fitting rows that do not fit.

``TrainingConfig.max_tokens_per_device`` promises that **no forward pass on a device sees more
than that many input tokens** (the packed row, or the padded ``[rows, width]`` micro-batch,
padding included). The promise is kept in one place, here, in three steps:

1. :meth:`TokenBudget.costs`: every row's *unit cost*, the tokens it puts into the largest
   forward pass it takes part in. The method says what that is (``budget_tokens`` on the loss;
   the default is the sum of the row's ``*input_ids`` lengths, packed, or ``sequences x longest``
   padded): a KTO row also brings its mismatched KL row, an online prompt brings
   ``G x (prompt + max_new_tokens)`` tokens of rollouts.
2. The planner (:mod:`grimoire.batching.steps`) bins those costs so each micro-batch's total is
   within the budget: summed for packed rows, ``rows x largest`` for padded ones.
3. A row that cannot fit is an error before training that names it (:meth:`problems`), or, with
   ``truncate_long_samples``, it is cut by the method's ``fit_to_budget`` so its whole unit fits
   (both sides of a pair, a KTO row with its KL row, a prompt with its completions).

Phases with their own batching take the budget from here too: the rollout engine splits
generation and scoring calls so each stays within it (:mod:`grimoire.rollout.engines.base`).

Under sequence parallelism (``training.sequence_parallel_size = N``) the budget stays **per
device**: a packed row is split over the ``N`` devices of its sequence group, each runs
``ceil(L / N)`` of its ``L`` tokens, so a micro-batch's row may hold ``N x max_tokens_per_device``
tokens (:attr:`TokenBudget.row_tokens`); that is what rows are costed, fitted and binned against.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from grimoire.columns import IGNORE_INDEX, column_values, columns_of, listed, sequence_prefixes
from grimoire.contract.method import Method

#: Columns that are token-aligned with their sequence's ``input_ids`` and are cut with it.
_ALIGNED = ("input_ids", "attention_mask", "labels", "position_ids")


def sequence_lengths(dataset: Any) -> list[dict[str, int]]:
    """Per row, ``{prefix: tokens}`` for each of its sequences (see :func:`sequence_prefixes`)."""
    prefixes = sequence_prefixes(columns_of(dataset))
    per_col = {p: [len(x) for x in column_values(dataset, f"{p}input_ids")] for p in prefixes}
    return [{p: per_col[p][i] for p in prefixes} for i in range(len(dataset))]


def padding_ratio(dataset: Any, batch_size: int, seed: int = 0, sample: int = 4096) -> float:
    """Positions a padded micro-batch computes per real token, estimated on the dataset.

    Up to ``sample`` rows are shuffled into micro-batches of ``batch_size``; each sequence column
    (``input_ids``, ``chosen_input_ids``, ...) is padded to its batch's longest. 1.0 means the rows
    are all the same length; 2.9 is the long-tailed SFT data of docs/performance.md.
    """
    n = len(dataset)
    if n == 0 or not sequence_prefixes(columns_of(dataset)):
        return 1.0
    rows = random.Random(seed).sample(range(n), min(n, sample))
    subset = dataset.select(rows) if hasattr(dataset, "select") else [dataset[i] for i in rows]
    lengths = sequence_lengths(subset)
    padded = real = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        for prefix in batch[0]:
            widths = [row[prefix] for row in batch]
            padded += len(widths) * max(widths)
            real += sum(widths)
    return padded / max(real, 1)


def default_budget_tokens(lengths: Mapping[str, int], packed: bool) -> int:
    """Tokens a row's sequences put into one forward pass.

    Packed: they are concatenated, so their sum. Padded: each sequence is a row of the batch
    padded to the batch's widest, so ``sequences x longest`` (the planner then multiplies by the
    micro-batch's largest unit, which covers the widest row).
    """
    if not lengths:
        return 1
    if packed:
        return sum(lengths.values())
    return len(lengths) * max(lengths.values())


def method_budget_tokens(method: Method, lengths: dict[str, int], packed: bool) -> int:
    """Tokens a row puts into its largest forward pass for ``method`` (its ``budget_tokens``;
    :class:`~grimoire.losses.base.GrimoireLoss`'s default is :func:`default_budget_tokens`)."""
    return int(method.budget_tokens(lengths, packed))


def water_level(lengths: list[int], budget: int) -> int:
    """The largest cap ``c`` with ``sum(min(n, c) for n in lengths) <= budget``.

    Cutting every sequence to ``c`` shortens the longest first, so a pair whose chosen side is
    long keeps its short rejected side whole.
    """
    if sum(lengths) <= budget:
        return max(lengths, default=0)
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def truncate_sequences(row: Mapping[str, Any], budget: int) -> dict[str, Any]:
    """``row`` with its sequences cut at the end (longest first) to at most ``budget`` tokens
    in total; token-aligned columns (``*attention_mask``, ``*labels``, ...) are cut alike."""
    prefixes = sequence_prefixes(row)
    cap = water_level([len(row[f"{p}input_ids"]) for p in prefixes], budget)
    out = dict(row)
    for p in prefixes:
        for col in _ALIGNED:
            key = f"{p}{col}"
            if key in out and isinstance(out[key], list | tuple):
                out[key] = list(out[key][:cap])
    return out


def untrainable(row: Mapping[str, Any]) -> list[str]:
    """Sequences of ``row`` that are empty or have a ``*labels`` column with no trained token."""
    bad = []
    for p in sequence_prefixes(row):
        labels = row.get(f"{p}labels")
        if not row[f"{p}input_ids"] or (
            labels is not None and all(x == IGNORE_INDEX for x in labels[1:])
        ):
            bad.append(f"{p}input_ids")
    return bad


@dataclass
class TokenBudget:
    """``max_tokens`` per forward pass for ``method``'s rows (see the module docstring).

    Args:
        max_tokens: ``TrainingConfig.max_tokens_per_device``.
        method: the method (:class:`~grimoire.contract.method.Method`): its
            ``budget_tokens(lengths, packed)``, ``fit_to_budget(row, budget)`` and
            ``budget_hint`` (defaults: :func:`default_budget_tokens`, :func:`truncate_sequences`).
        packed: whether micro-batches are packed rows (else padded tensors).
        truncate: ``TrainingConfig.truncate_long_samples``.
        sequence_parallel: ``TrainingConfig.sequence_parallel_size``: devices one packed row is
            split over (each holds ``1/N`` of it; the budget stays per device).
    """

    max_tokens: int
    method: Method
    packed: bool
    truncate: bool = False
    sequence_parallel: int = 1
    #: ``(dataset, its sequence_lengths)`` already read: validation and planning both need them,
    #: and reading every ``*input_ids`` column of a large dataset is the costly part.
    _seen: list[tuple[Any, list[dict[str, int]]]] = field(default_factory=list, repr=False)

    @property
    def row_tokens(self) -> int:
        """Tokens one micro-batch may hold: ``max_tokens`` on each of the ``sequence_parallel``
        devices that share its row (a row of ``L <= N x B`` tokens puts ``ceil(L / N) <= B`` on
        each)."""
        return self.max_tokens * self.sequence_parallel

    @property
    def limit(self) -> str:
        """The bound as the messages name it."""
        if self.sequence_parallel == 1:
            return f"max_tokens_per_device={self.max_tokens}"
        return (
            f"max_tokens_per_device={self.max_tokens} x sequence_parallel_size="
            f"{self.sequence_parallel} = {self.row_tokens} per row"
        )

    def cost(self, lengths: dict[str, int]) -> int:
        return method_budget_tokens(self.method, lengths, self.packed)

    def _lengths(self, dataset: Any) -> list[dict[str, int]]:
        for seen, lengths in self._seen:
            if seen is dataset:
                return lengths
        self._seen.append((dataset, sequence_lengths(dataset)))
        return self._seen[-1][1]

    def row_cost(self, row: Mapping[str, Any]) -> int:
        return self.cost({p: len(row[f"{p}input_ids"]) for p in sequence_prefixes(row)})

    def fit(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as it enters a micro-batch: cut to fit when it must and may be."""
        if not self.truncate or self.row_cost(row) <= self.row_tokens:
            return row
        return self.method.fit_to_budget(row, self.row_tokens)

    def costs(self, dataset: Any) -> list[int]:
        """Every row's cost as it will be trained (after :meth:`fit`)."""
        out = [self.cost(lengths) for lengths in self._lengths(dataset)]
        if self.truncate:
            out = [
                c if c <= self.row_tokens else self.row_cost(self.fit(dataset[i]))
                for i, c in enumerate(out)
            ]
        return out

    def problems(self, dataset: Any, split: str) -> list[str]:
        """Rows whose unit cannot fit the budget (or would train nothing once cut), named."""
        what = "that cannot be cut to fit" if self.truncate else "over the budget"
        return listed(self._problems(dataset, split), more=f"more {split} rows {what}")

    def _problems(self, dataset: Any, split: str) -> Iterator[str]:
        # A generator: listed() keeps the first few and only counts the rest.
        hint = self.method.budget_hint
        for i, lengths in enumerate(self._lengths(dataset)):
            cost = self.cost(lengths)
            if cost <= self.row_tokens:
                continue
            if not self.truncate:
                yield (
                    f"{split} row {i}: needs {cost} tokens in one forward pass "
                    f"({_describe(lengths)}{hint}) > {self.limit}; "
                    "set training.truncate_long_samples=true to cut it to fit, or raise "
                    "training.max_tokens_per_device (or tokenize with a smaller max_length)"
                )
                continue
            fitted = self.fit(dataset[i])
            left = self.row_cost(fitted)
            empty = untrainable(fitted)
            if left > self.row_tokens or empty:
                why = (
                    f"it still needs {left} tokens"
                    if left > self.row_tokens
                    else f"{' and '.join(empty)} would have no trained token left"
                )
                yield (
                    f"{split} row {i}: cut to {self.limit}, {why} "
                    f"({_describe(lengths)}{hint}); raise training.max_tokens_per_device or "
                    "shorten the row's prompt"
                )


def _describe(lengths: Mapping[str, int]) -> str:
    return ", ".join(f"{p or ''}input_ids {n}" for p, n in lengths.items())


__all__ = [
    "TokenBudget",
    "default_budget_tokens",
    "method_budget_tokens",
    "sequence_lengths",
    "truncate_sequences",
    "untrainable",
    "water_level",
]
