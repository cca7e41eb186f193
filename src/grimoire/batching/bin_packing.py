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

from grimoire.columns import listed
from grimoire.errors import DataError

try:  # numba is an optional speed-up ("speed" extra); the fallback runs the same source.
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    numba = None
    HAVE_NUMBA = False

#: Default for ``use_numba=None``. Set to False to force the pure-Python path process-wide
#: (e.g. to rule numba out while debugging); it produces identical plans, only slower.
USE_NUMBA: bool = HAVE_NUMBA


# --------------------------------------------------------------------------------------------
# Planner kernel
# --------------------------------------------------------------------------------------------
#
# One function, run either compiled by numba or as plain Python over lists. Because both paths
# execute the very same source on exact integers, they give identical plans by construction (the
# tests check it anyway). Everything is inlined (no helper calls) so that the function compiles
# on its own and numba can cache it; all buffers are passed in so the Python path can use lists,
# whose element access is several times faster than numpy scalar indexing.


def _plan_kernel(
    lengths,  # [n] sample lengths
    order,  # [n] sample indices sorted by length desc, ties by index asc
    num_ranks,
    max_tokens,
    max_len,  # max(lengths): leaves of the capacity tree cover remaining capacities [0, max_len)
    tree_size,  # P, a power of two >= max_len
    heap_load,  # [R] zeros
    heap_rank,  # [R] 0..R-1
    rank_of,  # [n] out: rank of each sample
    bin_of,  # [n] out: micro-batch (local to its rank) of each sample
    rank_bins,  # [R] out: number of non-empty micro-batches of each rank
    grouped,  # [n] scratch
    rank_start,  # [R + 1] zeros
    cursor,  # [R] scratch
    nf_bin,  # [n] scratch
    nf_count,  # [R] zeros
    nf_load,  # [R] zeros
    tree,  # [2P] zeros: tree[j] = number of non-empty capacity buckets under node j
    head,  # [max_len] -1: head[c] = a bin with exactly c tokens of room left, or -1
    nxt,  # [n] scratch: next bin in the same bucket (intrusive singly linked list)
    bin_rem,  # [n] scratch: remaining capacity of each bin of the current rank
):
    n = len(order)

    # 1) LPT across ranks: longest sample first, each to the least-loaded rank (ties: lowest
    #    rank). Min-heap on (load, rank); only the root ever changes, so "add to root and sift
    #    down" is the only operation needed. Keys are unique (ranks are), so the result does not
    #    depend on heap internals.
    for k in range(n):
        i = order[k]
        s = lengths[i]
        rank_of[i] = heap_rank[0]
        heap_load[0] += s
        pos = 0
        while True:
            child = 2 * pos + 1
            if child >= num_ranks:
                break
            right = child + 1
            if right < num_ranks and (
                heap_load[right] < heap_load[child]
                or (heap_load[right] == heap_load[child] and heap_rank[right] < heap_rank[child])
            ):
                child = right
            if heap_load[child] < heap_load[pos] or (
                heap_load[child] == heap_load[pos] and heap_rank[child] < heap_rank[pos]
            ):
                tmp_load = heap_load[pos]
                heap_load[pos] = heap_load[child]
                heap_load[child] = tmp_load
                tmp_rank = heap_rank[pos]
                heap_rank[pos] = heap_rank[child]
                heap_rank[child] = tmp_rank
                pos = child
            else:
                break

    # 2) Group samples by rank, keeping the length-descending order (counting sort).
    for i in range(n):
        rank_start[rank_of[i] + 1] += 1
    for r in range(num_ranks):
        rank_start[r + 1] += rank_start[r]
        cursor[r] = rank_start[r]
    for k in range(n):
        i = order[k]
        r = rank_of[i]
        grouped[cursor[r]] = i
        cursor[r] += 1

    # 3) Best-fit decreasing per rank: each sample goes to the bin with the least room that still
    #    fits it. Bins with room c < max_len sit in bucket c (a linked list; ties between equally
    #    full bins go to the most recently filed one, which is deterministic). A segment tree over
    #    c finds the smallest non-empty bucket >= s in O(log max_len). A bin with room >= max_len
    #    fits any sample; BFD only opens a bin when nothing fits, so at most one such "roomy" bin
    #    exists at a time and it needs no bucket. Memory is O(max_len), not O(max_tokens).
    for r in range(num_ranks):
        nb = 0
        roomy = -1
        for k in range(rank_start[r], rank_start[r + 1]):
            i = grouped[k]
            s = lengths[i]
            # smallest non-empty bucket c with s <= c < max_len, or -1
            found = -1
            if s < max_len:
                j = tree_size + s
                if tree[j] > 0:
                    found = s
                else:
                    while j > 1:
                        if (j & 1) == 0 and tree[j + 1] > 0:
                            j += 1
                            while j < tree_size:
                                j = 2 * j
                                if tree[j] == 0:
                                    j += 1
                            found = j - tree_size
                            break
                        j >>= 1
            if found >= 0:
                b = head[found]
                head[found] = nxt[b]
                if head[found] == -1:  # bucket emptied
                    j = tree_size + found
                    while j >= 1:
                        tree[j] -= 1
                        j >>= 1
                rem = found - s
            elif roomy >= 0:
                b = roomy
                rem = bin_rem[b] - s
                if rem < max_len:
                    roomy = -1
            else:
                b = nb
                nb += 1
                rem = max_tokens - s
                if rem >= max_len:
                    roomy = b
            bin_rem[b] = rem
            if 0 < rem < max_len:  # file the bin under its new room
                if head[rem] == -1:
                    j = tree_size + rem
                    while j >= 1:
                        tree[j] += 1
                        j >>= 1
                nxt[b] = head[rem]
                head[rem] = b
            bin_of[i] = b
        # Clear this rank's buckets so the next rank starts from an empty structure; touching only
        # the buckets in use keeps this O(bins log max_len) instead of O(max_len) per rank.
        for b in range(nb):
            rem = bin_rem[b]
            if 0 < rem < max_len and head[rem] != -1:
                head[rem] = -1
                j = tree_size + rem
                while j >= 1:
                    tree[j] -= 1
                    j >>= 1
        rank_bins[r] = nb

    # 4) The prefix-greedy (next-fit) packing of each rank's samples in index order. BFD can lose
    #    to it on a lucky input order; keeping the better of the two per rank makes the planner
    #    never worse than the naive packer, at O(n) extra cost.
    for i in range(n):
        r = rank_of[i]
        s = lengths[i]
        if nf_count[r] == 0 or nf_load[r] + s > max_tokens:
            nf_count[r] += 1
            nf_load[r] = s
        else:
            nf_load[r] += s
        nf_bin[i] = nf_count[r] - 1
    for i in range(n):
        r = rank_of[i]
        if nf_count[r] < rank_bins[r]:
            bin_of[i] = nf_bin[i]
    for r in range(num_ranks):
        if nf_count[r] < rank_bins[r]:
            rank_bins[r] = nf_count[r]


_plan_kernel_numba = numba.njit(cache=True, nogil=True)(_plan_kernel) if numba is not None else None


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
    if use_numba:
        assert _plan_kernel_numba is not None, "plan_global_batch checks numba is installed"
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
