"""The planner's kernel: ranks and micro-batches for one step's sample lengths, as integers.

One source, run either compiled by numba or as plain Python over lists. Because both paths
execute the very same code on exact integers, they give identical plans by construction (the
tests check it anyway). The phases are separate functions marked ``register_jitable``: plain
Python functions to the fallback, compiled into the one ``njit`` kernel (which numba caches) on
the fast path. All buffers are passed in so the Python path can use lists, whose element access
is several times faster than numpy scalar indexing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


try:  # numba is an optional speed-up ("speed" extra); the fallback runs the same source.
    import numba
    from numba.extending import register_jitable as _jitable
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    numba = None
    _jitable = None

HAVE_NUMBA = numba is not None
#: Compiled into the kernel that calls it under numba; a plain function otherwise.
register_jitable = _jitable or _plain


@register_jitable
def _lpt_ranks(lengths, order, num_ranks, heap_load, heap_rank, rank_of):
    """LPT across ranks: longest sample first, each to the least-loaded rank (ties: lowest
    rank). Min-heap on (load, rank); only the root ever changes, so "add to root and sift down"
    is the only operation needed. Keys are unique (ranks are), so the result does not depend on
    heap internals."""
    for k in range(len(order)):
        i = order[k]
        rank_of[i] = heap_rank[0]
        heap_load[0] += lengths[i]
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


@register_jitable
def _group_by_rank(order, num_ranks, rank_of, grouped, rank_start, cursor):
    """Samples grouped by rank, keeping the length-descending order (counting sort):
    ``grouped[rank_start[r]:rank_start[r + 1]]`` are rank ``r``'s."""
    n = len(order)
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


@register_jitable
def _tree_add(tree, tree_size, room, delta):
    """Add ``delta`` to the count of non-empty buckets on the path from bucket ``room`` up."""
    j = tree_size + room
    while j >= 1:
        tree[j] += delta
        j >>= 1


@register_jitable
def _smallest_bucket(tree, tree_size, size, max_len):
    """The smallest non-empty bucket ``c`` with ``size <= c < max_len``, or -1: a walk up the
    segment tree to the first right sibling holding one, then down to its leftmost leaf."""
    if size >= max_len:
        return -1
    j = tree_size + size
    if tree[j] > 0:
        return size
    while j > 1:
        if (j & 1) == 0 and tree[j + 1] > 0:
            j += 1
            while j < tree_size:
                j = 2 * j
                if tree[j] == 0:
                    j += 1
            return j - tree_size
        j >>= 1
    return -1


@register_jitable
def _best_fit_rank(
    lengths, samples, max_tokens, max_len, tree_size, bin_of, tree, head, nxt, bin_rem
):
    """Best-fit decreasing over one rank's ``samples``: each goes to the bin with the least room
    that still fits it; returns the number of bins.

    Bins with room ``c < max_len`` sit in bucket ``c`` (a linked list through ``head``/``nxt``;
    ties between equally full bins go to the most recently filed one, which is deterministic),
    and the segment tree finds the smallest non-empty bucket >= a size in O(log max_len). A bin
    with room >= max_len fits any sample; BFD only opens a bin when nothing fits, so at most one
    such "roomy" bin exists at a time and it needs no bucket. Memory is O(max_len), not
    O(max_tokens). The buckets are emptied again before returning, touching only those in use
    (O(bins log max_len) instead of O(max_len) per rank)."""
    nb = 0
    roomy = -1
    for i in samples:
        s = lengths[i]
        found = _smallest_bucket(tree, tree_size, s, max_len)
        if found >= 0:
            b = head[found]
            head[found] = nxt[b]
            if head[found] == -1:  # bucket emptied
                _tree_add(tree, tree_size, found, -1)
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
                _tree_add(tree, tree_size, rem, 1)
            nxt[b] = head[rem]
            head[rem] = b
        bin_of[i] = b
    for b in range(nb):
        rem = bin_rem[b]
        if 0 < rem < max_len and head[rem] != -1:
            head[rem] = -1
            _tree_add(tree, tree_size, rem, -1)
    return nb


@register_jitable
def _keep_next_fit_if_fewer(
    lengths, rank_of, bin_of, rank_bins, max_tokens, nf_bin, nf_count, nf_load
):
    """The prefix-greedy (next-fit) packing of each rank's samples in index order, kept where
    it needs fewer bins: BFD can lose to it on a lucky input order, and keeping the better of the
    two per rank makes the planner never worse than the naive packer, at O(n) extra cost."""
    n = len(lengths)
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
    for r in range(len(rank_bins)):
        if nf_count[r] < rank_bins[r]:
            rank_bins[r] = nf_count[r]


def plan_kernel(
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
    """Fill ``rank_of``, ``bin_of`` and ``rank_bins``: LPT across ranks, then per rank the
    better of best-fit decreasing and next-fit."""
    _lpt_ranks(lengths, order, num_ranks, heap_load, heap_rank, rank_of)
    _group_by_rank(order, num_ranks, rank_of, grouped, rank_start, cursor)
    for r in range(num_ranks):
        samples = grouped[rank_start[r] : rank_start[r + 1]]
        rank_bins[r] = _best_fit_rank(
            lengths, samples, max_tokens, max_len, tree_size, bin_of, tree, head, nxt, bin_rem
        )
    _keep_next_fit_if_fewer(
        lengths, rank_of, bin_of, rank_bins, max_tokens, nf_bin, nf_count, nf_load
    )


plan_kernel_numba = numba.njit(cache=True, nogil=True)(plan_kernel) if numba is not None else None

__all__ = ["HAVE_NUMBA", "plan_kernel", "plan_kernel_numba"]
