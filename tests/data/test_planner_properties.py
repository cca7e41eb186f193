"""Property tests for the token-budget planner, both cost models, directly and via StepPlanner.

Every expected value is computed here from scratch (micro-batch costs, coverage, rank loads, a
brute-force optimum); nothing calls into the planner's internals.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grimoire.batching.bin_packing import plan_global_batch
from grimoire.batching.steps import StepPlanner

SETTINGS = settings(max_examples=150, deadline=None)


# ----------------------------------------------------------------------------------------------
# independent checkers
# ----------------------------------------------------------------------------------------------


def cost(lengths, micro: list[int], padded: bool) -> int:
    """Tokens computed for one micro-batch: a packed row, or a padded rectangle."""
    if not micro:
        return 0
    sizes = [int(lengths[i]) for i in micro]
    return len(sizes) * max(sizes) if padded else sum(sizes)


def check_rank_plans(
    plans: list[list[list[int]]],
    lengths,
    expected: list[int],
    max_tokens: int,
    padded: bool,
    min_micro: int = 0,
) -> None:
    """Invariants of one global batch split into per-rank micro-batches.

    ``plans[rank][micro]`` holds indices into ``lengths``; ``expected`` lists the indices that
    must be covered, each exactly once.
    """
    num_micro = len(plans[0])
    assert all(len(rank) == num_micro for rank in plans), "ranks differ in micro-batch count"
    assert num_micro >= min_micro
    placed = Counter(i for rank in plans for mb in rank for i in mb)
    assert placed == Counter(expected), "coverage: every sample exactly once"
    for rank in plans:
        for mb in rank:
            assert cost(lengths, mb, padded) <= max_tokens, (mb, [lengths[i] for i in mb])
        real = [bool(mb) for mb in rank]
        assert real == sorted(real, reverse=True), "dummy micro-batches only at the end"
    busiest = max(sum(1 for mb in rank if mb) for rank in plans)
    assert num_micro == max(busiest, min_micro), "no more micro-batches than needed"
    if expected:
        # LPT: the most loaded rank got its last sample while it was the least loaded one.
        loads = [sum(int(lengths[i]) for mb in rank for i in mb) for rank in plans]
        assert max(loads) - min(loads) <= max(int(lengths[i]) for i in expected)


def min_padded_bins(sizes: list[int], max_tokens: int) -> int:
    """Fewest padded micro-batches for ``sizes``, by exhaustive search over subsets."""
    n = len(sizes)
    full = (1 << n) - 1

    def fits(mask: int) -> bool:
        members = [sizes[k] for k in range(n) if mask >> k & 1]
        return len(members) * max(members) <= max_tokens

    @cache
    def best(mask: int) -> int:
        if mask == 0:
            return 0
        low = mask & -mask  # the bin holding the lowest remaining sample
        rest = mask ^ low
        result = n + 1
        sub = rest
        while True:
            group = sub | low
            if fits(group):
                result = min(result, 1 + best(mask ^ group))
            if sub == 0:
                break
            sub = (sub - 1) & rest
        return result

    return best(full)


# ----------------------------------------------------------------------------------------------
# plan_global_batch
# ----------------------------------------------------------------------------------------------


@st.composite
def planner_inputs(draw, max_n: int = 60):
    max_tokens = draw(st.integers(1, 200))
    cap = draw(st.integers(1, max_tokens))  # sometimes all short, sometimes up to the budget
    lengths = draw(st.lists(st.integers(1, cap), max_size=max_n))
    num_ranks = draw(st.integers(1, 8))
    min_micro = draw(st.integers(0, 3))
    padded = draw(st.booleans())
    return lengths, num_ranks, max_tokens, min_micro, padded


@SETTINGS
@given(planner_inputs())
def test_plan_properties_both_cost_models(args):
    lengths, num_ranks, max_tokens, min_micro, padded = args
    plan = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, padded=padded)
    assert len(plan) == num_ranks
    for rank in plan:
        for mb in rank:
            assert mb == sorted(mb), "indices ascending within a micro-batch"
    check_rank_plans(plan, lengths, list(range(len(lengths))), max_tokens, padded, min_micro)
    # determinism, also across input container types
    again = plan_global_batch(tuple(lengths), num_ranks, max_tokens, min_micro, padded=padded)
    assert plan == again
    arr = np.asarray(lengths, dtype=np.int32)
    assert plan == plan_global_batch(arr, num_ranks, max_tokens, min_micro, padded=padded)


@SETTINGS
@given(planner_inputs())
def test_padded_and_packed_share_rank_assignment(args):
    lengths, num_ranks, max_tokens, min_micro, _ = args
    packed = plan_global_batch(lengths, num_ranks, max_tokens, min_micro)
    padded = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, padded=True)
    for rank_packed, rank_padded in zip(packed, padded):
        assert sorted(i for mb in rank_packed for i in mb) == sorted(
            i for mb in rank_padded for i in mb
        )


@SETTINGS
@given(planner_inputs())
def test_numba_and_fallback_identical_both_cost_models(args):
    pytest.importorskip("numba")
    lengths, num_ranks, max_tokens, min_micro, padded = args
    kw = {"padded": padded}
    fast = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, use_numba=True, **kw)
    slow = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, use_numba=False, **kw)
    assert fast == slow


@SETTINGS
@given(planner_inputs(max_n=8))
def test_padded_bins_per_rank_are_optimal(args):
    """Given the rank assignment, each rank uses the fewest padded micro-batches possible."""
    lengths, num_ranks, max_tokens, _, _ = args
    plan = plan_global_batch(lengths, num_ranks, max_tokens, 0, padded=True)
    for rank in plan:
        sizes = [lengths[i] for mb in rank for i in mb]
        assert sum(1 for mb in rank if mb) == min_padded_bins(sizes, max_tokens)


@SETTINGS
@given(planner_inputs())
def test_packed_bins_respect_volume_bound(args):
    lengths, num_ranks, max_tokens, _, _ = args
    plan = plan_global_batch(lengths, num_ranks, max_tokens, 0)
    for rank in plan:
        tokens = sum(lengths[i] for mb in rank for i in mb)
        assert sum(1 for mb in rank if mb) >= -(-tokens // max_tokens)


# ----------------------------------------------------------------------------------------------
# StepPlanner: whole epochs, all ranks
# ----------------------------------------------------------------------------------------------


@st.composite
def step_planner_inputs(draw):
    num_samples = draw(st.integers(1, 40))
    max_tokens = draw(st.integers(1, 120))
    lengths = draw(st.lists(st.integers(1, max_tokens), min_size=num_samples, max_size=num_samples))
    budget = None if draw(st.integers(0, 4)) == 0 else max_tokens  # mostly token budgets
    planner = StepPlanner(
        num_samples=num_samples,
        batch_size=draw(st.integers(1, 4)),
        grad_accum=draw(st.integers(1, 3)),
        world_size=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 1000)),
        lengths=lengths,
        max_tokens_per_device=budget,
        shuffle=draw(st.booleans()),
        repeat=draw(st.integers(1, 2)),
        padded=draw(st.booleans()),
    )
    epochs = draw(st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True))
    return planner, epochs


def all_rank_plans(planner: StepPlanner, epoch: int, step: int) -> list[list[list[int]]]:
    return [
        dataclasses.replace(planner, rank=r).plan(epoch, step) for r in range(planner.world_size)
    ]


@SETTINGS
@given(step_planner_inputs())
def test_step_planner_covers_each_epoch_exactly_once(args):
    planner, epochs = args
    n, lengths, budget = planner.num_samples, planner.lengths, planner.max_tokens_per_device
    steps = planner.steps_per_epoch
    assert steps % planner.repeat == 0
    for epoch in epochs:
        seen: Counter[int] = Counter()
        batch_sizes = []
        for step in range(steps):
            plans = all_rank_plans(planner, epoch, step)
            batch = [i for rank in plans for mb in rank for i in mb]
            if step % planner.repeat:  # repeated optimizer steps reuse the same global batch
                assert plans == all_rank_plans(planner, epoch, step - 1)
                continue
            assert len(set(batch)) == len(batch)
            assert all(0 <= i < n for i in batch)
            batch_sizes.append(len(batch))
            seen.update(batch)
            if budget is None:
                assert all(len(rank) == planner.grad_accum for rank in plans)
                assert all(len(mb) <= planner.batch_size for rank in plans for mb in rank)
            else:
                check_rank_plans(plans, lengths, batch, budget, planner.padded, min_micro=1)
            # determinism: a fresh planner (as after a resume) gives the same plan
            assert plans == all_rank_plans(dataclasses.replace(planner), epoch, step)
        assert seen == Counter(range(n)), "each dataset index exactly once per epoch"
        # full global batches, only the last one may be short
        assert all(size == planner.global_batch for size in batch_sizes[:-1])
        assert 1 <= batch_sizes[-1] <= planner.global_batch
