"""Tests for padding-free packing: the global-batch planner, collation and per-sample reduction.

References are written here independently: a prefix-greedy packer, a naive per-sample loop,
hand-worked layouts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grimoire.batching import bin_packing as planner
from grimoire.batching.bin_packing import plan_global_batch
from grimoire.collate import packing
from grimoire.collate.packing import pack_samples, padding_fraction, segment_sum
from grimoire.contract.layout import LAYOUT_KEY, Packed
from grimoire.errors import DataError
from grimoire.forward.logprobs import IGNORE_INDEX, shift_labels

# ----------------------------------------------------------------------------------------------
# references and helpers
# ----------------------------------------------------------------------------------------------


def prefix_greedy_bins(lengths: list[int], max_tokens: int) -> int:
    """Walk samples in order; start a new bin whenever the next one does not fit."""
    bins, load = 0, 0
    for s in lengths:
        if bins == 0 or load + s > max_tokens:
            bins, load = bins + 1, s
        else:
            load += s
    return bins


def naive_multi_rank_micro_batches(lengths: list[int], num_ranks: int, max_tokens: int) -> int:
    """Round-robin sharding (DistributedSampler style), prefix-greedy per rank; all ranks must
    run as many micro-batches as the busiest one."""
    return max(prefix_greedy_bins(lengths[r::num_ranks], max_tokens) for r in range(num_ranks))


def pareto_lengths(seed: int, n: int, lo: int = 16, hi: int = 2048) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.minimum(hi, lo + (rng.pareto(1.5, n) * 200).astype(np.int64)).tolist()


def check_plan(
    plan: list[list[list[int]]],
    lengths: list[int],
    num_ranks: int,
    max_tokens: int,
    min_micro_batches: int,
) -> None:
    """All invariants a plan must satisfy, checked from scratch."""
    assert len(plan) == num_ranks
    num_micro = len(plan[0])
    assert all(len(rank) == num_micro for rank in plan), "ranks differ in micro-batch count"
    assert num_micro >= min_micro_batches
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(lengths))), "every sample exactly once"
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= max_tokens
            assert mb == sorted(mb)
        # dummies (empty) only after the real micro-batches
        real = [bool(mb) for mb in rank]
        assert real == sorted(real, reverse=True)
    # no more micro-batches than the busiest rank needs (or the requested minimum)
    busiest = max(sum(1 for mb in rank if mb) for rank in plan)
    assert num_micro == max(busiest, min_micro_batches)


def rank_loads(plan: list[list[list[int]]], lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for mb in rank for i in mb) for rank in plan]


@st.composite
def planner_inputs(draw):
    max_tokens = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, max_tokens), max_size=60))
    num_ranks = draw(st.integers(1, 6))
    min_micro = draw(st.integers(0, 3))
    return lengths, num_ranks, max_tokens, min_micro


# ----------------------------------------------------------------------------------------------
# plan_global_batch: properties
# ----------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(planner_inputs())
def test_plan_invariants(args):
    lengths, num_ranks, max_tokens, min_micro = args
    plan = plan_global_batch(lengths, num_ranks, max_tokens, min_micro)
    check_plan(plan, lengths, num_ranks, max_tokens, min_micro)
    assert plan == plan_global_batch(list(lengths), num_ranks, max_tokens, min_micro)
    if lengths:
        # LPT guarantee: the most loaded rank got its last sample while it was the least loaded.
        loads = rank_loads(plan, lengths)
        assert max(loads) - min(loads) <= max(lengths)


@settings(max_examples=100, deadline=None)
@given(planner_inputs())
def test_numba_and_fallback_plans_identical(args):
    pytest.importorskip("numba")
    lengths, num_ranks, max_tokens, min_micro = args
    fast = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, use_numba=True)
    slow = plan_global_batch(lengths, num_ranks, max_tokens, min_micro, use_numba=False)
    assert fast == slow


@settings(max_examples=100, deadline=None)
@given(planner_inputs())
def test_single_rank_never_worse_than_prefix_greedy(args):
    lengths, _, max_tokens, _ = args
    plan = plan_global_batch(lengths, 1, max_tokens, min_micro_batches=0)
    assert len(plan[0]) <= prefix_greedy_bins(lengths, max_tokens)
    assert len(plan[0]) >= math.ceil(sum(lengths) / max_tokens)  # sanity: volume bound


def test_numba_and_fallback_identical_on_larger_input():
    pytest.importorskip("numba")
    lengths = pareto_lengths(7, 20_000)
    fast = plan_global_batch(lengths, 8, 8192, use_numba=True)
    slow = plan_global_batch(lengths, 8, 8192, use_numba=False)
    assert fast == slow


def test_module_flag_forces_fallback(monkeypatch):
    def boom(*args):
        raise AssertionError("numba kernel used although USE_NUMBA is False")

    monkeypatch.setattr(planner, "_plan_kernel_numba", boom)
    monkeypatch.setattr(planner, "USE_NUMBA", False)
    assert plan_global_batch([6, 5, 4, 5], 1, 10) == [[[0, 2], [1, 3]]]


def test_collation_does_not_import_the_planner():
    """Collating never loads numba: the planner lives in its own module."""
    assert not hasattr(packing, "plan_global_batch")
    assert not hasattr(packing, "USE_NUMBA")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_tokens", [4096, 16384])
def test_realistic_balance_and_micro_batch_count(seed, max_tokens):
    lengths = pareto_lengths(seed, 4096)
    num_ranks = 8
    plan = plan_global_batch(lengths, num_ranks, max_tokens)
    check_plan(plan, lengths, num_ranks, max_tokens, 1)
    loads = rank_loads(plan, lengths)
    assert max(loads) / (sum(loads) / num_ranks) < 1.05
    naive = naive_multi_rank_micro_batches(lengths, num_ranks, max_tokens)
    assert len(plan[0]) < naive
    # within one micro-batch of the volume lower bound of the whole step
    assert len(plan[0]) <= math.ceil(sum(lengths) / (num_ranks * max_tokens)) + 1


def test_strictly_fewer_than_prefix_greedy_on_crafted_case():
    # prefix-greedy: [6] [5, 4] [5] = 3 bins; best-fit decreasing: [6, 4] [5, 5] = 2 bins.
    lengths = [6, 5, 4, 5]
    assert prefix_greedy_bins(lengths, 10) == 3
    assert plan_global_batch(lengths, 1, 10) == [[[0, 2], [1, 3]]]


def test_keeps_prefix_greedy_when_it_is_better():
    # Best-fit decreasing needs 3 bins ([4, 4] [3, 3, 3] [3]); the input order packs perfectly.
    lengths = [4, 3, 3, 4, 3, 3]
    assert prefix_greedy_bins(lengths, 10) == 2
    assert plan_global_batch(lengths, 1, 10) == [[[0, 1, 2], [3, 4, 5]]]


def test_lpt_hand_worked():
    # Longest first, to the least loaded rank (ties -> lower rank):
    # 6->r0, 5(#1)->r1, 5(#3)->r2, 4->r1 (5 vs 5 tie), 3->r2, 1(#4)->r0, 1(#5)->r0.
    plan = plan_global_batch([6, 5, 4, 5, 1, 1, 3], 3, 10)
    assert plan == [[[0, 4, 5]], [[1, 2]], [[3, 6]]]


def test_deterministic_across_input_types():
    lengths = pareto_lengths(3, 500)
    a = plan_global_batch(lengths, 4, 4096)
    assert a == plan_global_batch(tuple(lengths), 4, 4096)
    assert a == plan_global_batch(np.asarray(lengths, dtype=np.int32), 4, 4096)
    assert a == plan_global_batch(torch.tensor(lengths), 4, 4096)


# ----------------------------------------------------------------------------------------------
# plan_global_batch: boundaries and errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_micro", [0, 1, 2])
def test_empty_input(min_micro):
    assert plan_global_batch([], 3, 100, min_micro) == [[[] for _ in range(min_micro)]] * 3


def test_exact_fit_is_one_micro_batch():
    assert plan_global_batch([3, 3, 4], 1, 10) == [[[0, 1, 2]]]


def test_sample_of_exactly_max_tokens():
    # 10 fills a bin alone; 7 opens the second, 3 fits next to it.
    assert plan_global_batch([10, 3, 7], 1, 10) == [[[0], [1, 2]]]


def test_sample_over_budget_names_index_and_length():
    with pytest.raises(ValueError, match=r"sample 1 has 11 tokens") as info:
        plan_global_batch([5, 11, 10, 12], 2, 10)
    msg = str(info.value)
    assert isinstance(info.value, DataError)
    assert "sample 3 has 12 tokens" in msg and "sample 2" not in msg
    assert "truncate" in msg and "max_tokens" in msg


def test_empty_sample_rejected():
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        plan_global_batch([3, 0], 1, 10)


def test_more_ranks_than_samples_and_min_micro_batches():
    assert plan_global_batch([5], 3, 10) == [[[0]], [[]], [[]]]
    assert plan_global_batch([1, 1], 1, 10, min_micro_batches=3) == [[[0, 1], [], []]]


@pytest.mark.parametrize(
    "kwargs", [{"num_ranks": 0, "max_tokens": 8}, {"num_ranks": 1, "max_tokens": 0}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        plan_global_batch([1, 2], **kwargs)


# ----------------------------------------------------------------------------------------------
# plan_global_batch(padded=True): cost = rows * longest sample
# ----------------------------------------------------------------------------------------------


def test_padded_exact_fit_rows_times_width():
    # 3 rows x width 4 = 12: one micro-batch at budget 12, although the token sum is only 9
    assert plan_global_batch([4, 3, 2], 1, 12, padded=True) == [[[0, 1, 2]]]
    # at 11 the longest opens a bin of 11 // 4 = 2 rows; the 2 goes to a second bin
    assert plan_global_batch([4, 3, 2], 1, 11, padded=True) == [[[0, 1], [2]]]
    # packed mode fits all three in 11 tokens
    assert plan_global_batch([4, 3, 2], 1, 11) == [[[0, 1, 2]]]


def test_padded_sample_of_exactly_max_tokens():
    # longest first: 10 alone (10 // 10 = 1 row), 7 alone (10 // 7 = 1), then 3
    assert plan_global_batch([10, 3, 7], 1, 10, padded=True) == [[[0], [2], [1]]]


def test_padded_lpt_hand_worked():
    # Same LPT as packed mode (see test_lpt_hand_worked): r0 = {0, 4, 5}, r1 = {1, 2},
    # r2 = {3, 6}. r0's 6 takes 10 // 6 = 1 row, so r0 needs two micro-batches; the others one,
    # padded with a dummy.
    plan = plan_global_batch([6, 5, 4, 5, 1, 1, 3], 3, 10, padded=True)
    assert plan == [[[0], [4, 5]], [[1, 2], []], [[3, 6], []]]


def test_padded_equal_lengths_ties_by_index():
    assert plan_global_batch([2] * 7, 1, 6, padded=True) == [[[0, 1, 2], [3, 4, 5], [6]]]


@pytest.mark.parametrize("min_micro", [0, 2])
def test_padded_empty_input(min_micro):
    plan = plan_global_batch([], 2, 8, min_micro, padded=True)
    assert plan == [[[] for _ in range(min_micro)]] * 2


def test_padded_sample_over_budget_names_it():
    with pytest.raises(DataError, match=r"sample 2 has 9 tokens > max_tokens=8") as info:
        plan_global_batch([8, 1, 9], 1, 8, padded=True)
    assert "sample 0" not in str(info.value)
    with pytest.raises(DataError, match="sample 0 has length 0"):
        plan_global_batch([0, 1], 1, 8, padded=True)


def test_padded_numba_and_fallback_identical():
    pytest.importorskip("numba")
    lengths = pareto_lengths(5, 5_000)
    fast = plan_global_batch(lengths, 8, 8192, padded=True, use_numba=True)
    assert fast == plan_global_batch(lengths, 8, 8192, padded=True, use_numba=False)
    for rank in fast:
        for mb in rank:
            assert not mb or len(mb) * max(lengths[i] for i in mb) <= 8192


# ----------------------------------------------------------------------------------------------
# pack_samples
# ----------------------------------------------------------------------------------------------


def three_samples(prefix: str = "") -> list[dict]:
    return [
        {f"{prefix}input_ids": [1, 2, 3], f"{prefix}labels": [-100, 2, 3]},
        {f"{prefix}input_ids": [4], f"{prefix}labels": [4]},
        {f"{prefix}input_ids": [5, 6], f"{prefix}labels": [-100, 6]},
    ]


def test_pack_samples_layout():
    out = pack_samples(three_samples(), pad_token_id=0)
    assert set(out) == {"input_ids", "labels", "position_ids", "sample_index", LAYOUT_KEY}
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert out["labels"].tolist() == [[-100, 2, 3, 4, -100, 6]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert out[LAYOUT_KEY] == Packed((3, 1, 2))
    assert out["sample_index"].tolist() == [[0, 0, 0, 1, 2, 2]]
    for key in ("input_ids", "labels", "position_ids", "sample_index"):
        assert out[key].dtype == torch.long


def test_packed_targets_never_cross_sample_boundaries():
    out = pack_samples(three_samples(), pad_token_id=0)
    targets = shift_labels(out["labels"], out["position_ids"])
    # predicting position t gets labels[t + 1], except where t + 1 starts a sample (t = 2, 3)
    # and at the last position.
    assert targets.tolist() == [[2, 3, IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX]]
    boundaries = [t for t in range(5) if out["position_ids"][0, t + 1] == 0]
    assert all(targets[0, t] == IGNORE_INDEX for t in boundaries)


def test_pack_prefix_columns_and_tensor_inputs():
    samples = [
        {k: torch.tensor(v) for k, v in s.items()} | {"other": 1} for s in three_samples("chosen_")
    ]
    out = pack_samples(samples, pad_token_id=0, prefix="chosen_")
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert out["labels"].tolist() == [[-100, 2, 3, 4, -100, 6]]
    assert "chosen_input_ids" not in out


def test_pack_one_token_sample():
    out = pack_samples([{"input_ids": [7], "labels": [7]}], pad_token_id=0)
    assert out["input_ids"].tolist() == [[7]]
    assert out["position_ids"].tolist() == [[0]]
    assert out[LAYOUT_KEY] == Packed((1,))
    assert out["sample_index"].tolist() == [[0]]
    assert shift_labels(out["labels"], out["position_ids"]).tolist() == [[IGNORE_INDEX]]


def test_pack_extra_float_column_keeps_dtype():
    samples = [
        {"input_ids": [1, 2], "labels": [1, 2], "weights": [0.5, 1.0]},
        {"input_ids": [3], "labels": [3], "weights": [2.0]},
    ]
    out = pack_samples(samples, 0, columns=("input_ids", "labels", "weights"))
    assert out["weights"].dtype == torch.float32
    assert out["weights"].tolist() == [[0.5, 1.0, 2.0]]


def test_pack_pad_to_multiple_of():
    out = pack_samples(three_samples(), pad_token_id=9, pad_to_multiple_of=4)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 9, 9]]
    assert out["labels"].tolist() == [[-100, 2, 3, 4, -100, 6, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert out["sample_index"].tolist() == [[0, 0, 0, 1, 2, 2, -1, -1]]
    assert out[LAYOUT_KEY].seq_lens == (3, 1, 2)
    # already aligned -> untouched
    assert pack_samples(three_samples(), 9, pad_to_multiple_of=3)["input_ids"].shape == (1, 6)


def test_pack_errors():
    with pytest.raises(ValueError, match="empty micro-batch"):
        pack_samples([], pad_token_id=0)
    with pytest.raises(DataError, match="missing column 'labels'"):
        pack_samples([{"input_ids": [1]}], pad_token_id=0)
    with pytest.raises(DataError, match="has 1 values, expected 2"):
        pack_samples([{"input_ids": [1, 2], "labels": [1]}], pad_token_id=0)
    with pytest.raises(DataError, match="no tokens"):
        pack_samples([{"input_ids": [], "labels": []}], pad_token_id=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack_samples(three_samples(), pad_token_id=0, pad_to_multiple_of=0)


# ----------------------------------------------------------------------------------------------
# segment_sum, padding_fraction
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape2d", [True, False])
def test_segment_sum_matches_naive_loop(shape2d):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [3, 1, 5, 2]
    idx = [k for k, n in enumerate(seq_lens) for _ in range(n)] + [-1, -1]  # two pad positions
    values = torch.randn(len(idx), generator=gen, dtype=torch.float64)
    index = torch.tensor(idx)
    if shape2d:
        values, index = values[None], index[None]
    got = segment_sum(values, index, len(seq_lens))
    flat_v = values.reshape(-1).tolist()
    expected = [0.0] * len(seq_lens)
    for v, k in zip(flat_v, idx):
        if k >= 0:
            expected[k] += v
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_segment_sum_gradient_and_packed_row():
    out = pack_samples(three_samples(), pad_token_id=0, pad_to_multiple_of=4)
    values = torch.arange(8, dtype=torch.float32).reshape(1, 8).requires_grad_()
    sums = segment_sum(values, out["sample_index"], out[LAYOUT_KEY].num_samples)
    assert sums.tolist() == [0 + 1 + 2, 3, 4 + 5]
    sums.sum().backward()
    assert values.grad.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]


def test_segment_sum_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        segment_sum(torch.zeros(1, 4), torch.zeros(4, dtype=torch.long), 1)


def test_padding_fraction_hand_worked():
    micro = [[2, 4], [3], []]
    # padded: 2*4 + 1*3 = 11 positions for 9 tokens
    assert padding_fraction(micro, padded=True) == pytest.approx(2 / 11)
    assert padding_fraction(micro, padded=False) == 0.0
    # packed rows rounded up to 4: 8 + 4 = 12 positions
    assert padding_fraction(micro, padded=False, pad_to_multiple_of=4) == pytest.approx(3 / 12)
    assert padding_fraction([[], []], padded=True) == 0.0
