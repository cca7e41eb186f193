"""Planning stage of padding-free training: which rank and micro-batch each sample goes to.

:func:`plan_global_batch` assigns the samples of one optimizer step to ranks and token-budget
micro-batches: pure integer bookkeeping on token lengths (numba-accelerated when installed, with
a pure-Python fallback that runs the same source). It reads no tensors and touches no model or
process group; :mod:`grimoire.collate.packing` collates the planned micro-batches, and
:class:`grimoire.batching.steps.StepPlanner` calls the planner once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from grimoire.batching.plan_kernel import HAVE_NUMBA, plan_kernel, plan_kernel_numba
from grimoire.columns import listed
from grimoire.errors import DataError

#: Default for ``use_numba=None``. Set to False to force the pure-Python path process-wide
#: (e.g. to rule numba out while debugging); it produces identical plans, only slower.
USE_NUMBA: bool = HAVE_NUMBA


# The kernel (:mod:`grimoire.batching.plan_kernel`), named here so a test can swap the compiled
# one out.
_plan_kernel = plan_kernel
_plan_kernel_numba = plan_kernel_numba


def _run_kernel(
    lengths: np.ndarray, num_ranks: int, max_tokens: int, use_numba: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate buffers and run the kernel; returns ``(rank_of, bin_of, rank_bins)`` arrays."""
    n = len(lengths)
    max_len = int(lengths.max())
    tree_size = 1
    while tree_size < max_len:
        tree_size *= 2
    # Stable sort on -length: longest first, ties by ascending sample index.
    order = np.argsort(-lengths, kind="stable")

    def buf(size: int, fill: int = 0) -> Any:
        return np.full(size, fill, dtype=np.int64) if use_numba else [fill] * size

    args = (
        lengths if use_numba else lengths.tolist(),
        order if use_numba else order.tolist(),
        num_ranks,
        max_tokens,
        max_len,
        tree_size,
        buf(num_ranks),
        np.arange(num_ranks, dtype=np.int64) if use_numba else list(range(num_ranks)),
        buf(n),
        buf(n),
        buf(num_ranks),
        buf(n),
        buf(num_ranks + 1),
        buf(num_ranks),
        buf(n),
        buf(num_ranks),
        buf(num_ranks),
        buf(2 * tree_size),
        buf(max_len, -1),
        buf(n),
        buf(n),
    )
    if use_numba and _plan_kernel_numba is not None:
        _plan_kernel_numba(*args)
    else:
        _plan_kernel(*args)
    rank_of, bin_of, rank_bins = args[8], args[9], args[10]
    return (
        np.asarray(rank_of, dtype=np.int64),
        np.asarray(bin_of, dtype=np.int64),
        np.asarray(rank_bins, dtype=np.int64),
    )


def _as_lengths(lengths: Sequence[int]) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    # one contiguous int64 layout, so numba compiles (and caches) a single specialisation
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_lengths(lengths: np.ndarray, max_tokens: int) -> None:
    """Raise :class:`DataError` (a ValueError) naming every empty or over-budget sample."""
    too_long = np.flatnonzero(lengths > max_tokens)
    empty = np.flatnonzero(lengths < 1)
    # Named up to MAX_LISTED, the rest counted: a badly truncated dataset gives no
    # million-line message.
    problems = listed(
        chain(
            (f"sample {i} has length {lengths[i]} (must be >= 1)" for i in empty),
            (f"sample {i} has {lengths[i]} tokens > max_tokens={max_tokens}" for i in too_long),
        )
    )
    if len(too_long):
        title = (
            f"{len(too_long)} sample(s) longer than the micro-batch token budget "
            f"max_tokens={max_tokens}: truncate them (lower the max sequence length) or raise "
            "max_tokens"
        )
    else:
        title = "samples with no tokens"
    if problems:
        raise DataError(problems, title=title)


def _padded_bins(
    lengths: np.ndarray, rank_of: np.ndarray, num_ranks: int, max_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Padded micro-batches per rank, cost ``rows * longest``; returns ``(bin_of, rank_bins)``.

    Each rank's samples, longest first (ties by index), are cut into consecutive runs; a run
    opened by a sample of length ``w`` takes up to ``max_tokens // w`` samples. This is optimal
    (fewest micro-batches): in any valid packing the micro-batch holding the longest sample has
    at most ``max_tokens // w`` rows; swapping its other members for the next-longest samples and
    then moving further next-longest ones into it (up to that cap) never raises any micro-batch's
    cost, so some optimal packing starts with the greedy run; induct on the rest. The Python loop
    runs once per micro-batch, not per sample.
    """
    order = np.argsort(-lengths, kind="stable")  # longest first, ties by index (as the kernel)
    by_rank = order[np.argsort(rank_of[order], kind="stable")]  # grouped by rank, order kept
    widths = lengths[by_rank].tolist()
    counts = np.bincount(rank_of, minlength=num_ranks).tolist()
    local = np.empty(len(lengths), dtype=np.int64)  # micro-batch of each position of by_rank
    rank_bins = np.zeros(num_ranks, dtype=np.int64)
    start = 0
    for r in range(num_ranks):
        end, pos, nb = start + counts[r], start, 0
        while pos < end:
            take = min(max_tokens // widths[pos], end - pos)
            local[pos : pos + take] = nb
            pos += take
            nb += 1
        rank_bins[r] = nb
        start = end
    bin_of = np.empty(len(lengths), dtype=np.int64)
    bin_of[by_rank] = local
    return bin_of, rank_bins


def plan_global_batch(
    lengths: Sequence[int],
    num_ranks: int,
    max_tokens: int,
    min_micro_batches: int = 1,
    *,
    padded: bool = False,
    use_numba: bool | None = None,
) -> list[list[list[int]]]:
    """Assign the samples of one optimizer step to ranks and token-budget micro-batches.

    Args:
        lengths: token count of each sample of the global batch; sample ``i`` is ``lengths[i]``.
        num_ranks: data-parallel world size.
        max_tokens: token budget of one micro-batch.
        min_micro_batches: every rank gets at least this many micro-batches.
        padded: cost model of a micro-batch. ``False``: one packed ``[1, L]`` row costing the sum
            of its samples' lengths. ``True``: a padded ``[rows, width]`` tensor costing
            ``rows * width``, ``width`` being its longest sample.
        use_numba: ``None`` follows the module flag :data:`USE_NUMBA`; ``False`` forces the
            pure-Python path (identical output); ``True`` requires numba.

    Returns:
        ``plan[rank][micro]`` = ascending sample indices of that micro-batch. Every sample appears
        exactly once, every micro-batch costs ``<= max_tokens`` (under the chosen cost model),
        and all ranks have the same number of micro-batches
        ``M = max(min_micro_batches, most bins any rank needs)`` (collective ops in FSDP/DDP need
        every rank to run the same number of forward/backward passes). Ranks that need fewer
        bins get trailing empty lists: dummy micro-batches the trainer runs with loss weight 0.
        Empty ``lengths`` gives ``min_micro_batches`` empty micro-batches per rank.

    Algorithm (balance first, then pack):

    1. LPT across ranks: samples longest first, each to the currently least-loaded rank. This
       bounds ``max_load - min_load`` by the length of one sample, and in practice by the
       shortest ones, since those are placed last and fill the gaps.
    2. Per rank, best-fit decreasing bin packing (``11/9 OPT + O(1)`` bins worst case, and
       nearly always ``ceil(rank_tokens / max_tokens)`` when samples are short relative to the
       budget), keeping the prefix-greedy packing instead if that happens to use fewer bins, so
       the result is never worse than the naive packer on the same rank.

    With ``padded=True`` step 1 is the same LPT (token sums, so ranks are balanced in real
    tokens), and step 2 becomes a greedy cut of each rank's samples sorted longest first (ties by
    index): a micro-batch opened by a sample of length ``w`` takes the next ``max_tokens // w``
    samples (it included), the most rows a ``[rows, w]`` tensor can have. That uses the fewest
    micro-batches possible for the rank's samples under this cost (see :func:`_padded_bins`).
    The kernel still runs its packed step 2 (discarded); it costs little next to the sort.

    The reverse order (bin-pack globally, then deal bins to ranks) only balances at bin
    granularity: with a handful of micro-batches per rank, one extra bin is a 10-30% imbalance,
    while LPT balances to within a sample. Compute per step is set by the slowest rank, so balance
    comes first; the bin count per rank then follows from the balanced token total.

    Deterministic: ties in length are broken by sample index and ties in load by rank index.
    Runs in ``O(n log n)`` (the sort) plus ``O(n log max_len)`` time and ``O(n + max_len)``
    memory (``max_len`` = longest sample); 1M samples take under a second with numba.

    Raises:
        DataError: (a ``ValueError``) when a sample is empty or longer than ``max_tokens``,
            naming every such sample by index and length.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if min_micro_batches < 0:
        raise ValueError(f"min_micro_batches must be >= 0, got {min_micro_batches}")
    if use_numba is None:
        use_numba = USE_NUMBA
    if use_numba and not HAVE_NUMBA:
        raise ImportError("use_numba=True but numba is not installed (pip install numba)")

    arr = _as_lengths(lengths)
    if arr.size == 0:
        return [[[] for _ in range(min_micro_batches)] for _ in range(num_ranks)]
    _check_lengths(arr, max_tokens)

    rank_of, bin_of, rank_bins = _run_kernel(arr, num_ranks, int(max_tokens), bool(use_numba))
    if padded:  # keep the kernel's LPT rank assignment, replace its (packed) bins
        bin_of, rank_bins = _padded_bins(arr, rank_of, num_ranks, int(max_tokens))
    num_micro = max(int(rank_bins.max()), min_micro_batches)

    # Group sample indices by (rank, micro) with one stable sort: indices come out ascending
    # within each group, and a rank's unused trailing slots are empty.
    key = rank_of * num_micro + bin_of
    flat = np.argsort(key, kind="stable").tolist()
    bounds = np.concatenate(([0], np.cumsum(np.bincount(key, minlength=num_ranks * num_micro))))
    bounds = bounds.tolist()
    return [
        [flat[bounds[g] : bounds[g + 1]] for g in range(r * num_micro, (r + 1) * num_micro)]
        for r in range(num_ranks)
    ]


def warmup_numba() -> None:
    """Compile (or load from cache) the numba planner kernel, so the first real step is not
    charged for it. A no-op without numba."""
    if HAVE_NUMBA:
        plan_global_batch([3, 2, 2, 1], num_ranks=2, max_tokens=4, use_numba=True)


__all__ = ["HAVE_NUMBA", "USE_NUMBA", "plan_global_batch", "warmup_numba"]
