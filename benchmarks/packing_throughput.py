"""Packer-only benchmark: planner speed and packing quality on Pareto-like sample lengths.

Run: ``PYTHONPATH=src python benchmarks/packing_throughput.py`` (about 10-30 s on one CPU core).

Compares :func:`grimoire.batching.bin_packing.plan_global_batch` against the naive scheme it replaces:
round-robin sharding of samples to ranks (DistributedSampler style) plus prefix-greedy packing per
rank (walk in order, start a new micro-batch when the next sample does not fit). Also reports
how much of the compute padded batching (fixed samples per micro-batch, padded to the longest)
spends on padding, against padding-free packed rows.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from grimoire.batching.bin_packing import HAVE_NUMBA, plan_global_batch, warmup_numba
from grimoire.collate.packing import padding_fraction


def pareto_lengths(n: int, seed: int, lo: int = 16, hi: int = 2048) -> np.ndarray:
    """Heavy-tailed lengths like SFT data: median ~120 tokens, long tail clipped at ``hi``."""
    rng = np.random.default_rng(seed)
    return np.minimum(hi, lo + (rng.pareto(1.5, n) * 200).astype(np.int64))


def prefix_greedy(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches (lists of lengths) of the naive packer."""
    bins: list[list[int]] = []
    load = 0
    for s in lengths:
        if not bins or load + s > max_tokens:
            bins.append([s])
            load = s
        else:
            bins[-1].append(s)
            load += s
    return bins


def best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="samples in the global batch")
    parser.add_argument("--n-fallback", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--padded-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = pareto_lengths(args.n, args.seed)
    as_list = lengths.tolist()
    total = int(lengths.sum())
    print(
        f"samples={args.n:,}  tokens={total:,}  mean={lengths.mean():.0f}  "
        f"median={np.median(lengths):.0f}  max={lengths.max()}  ranks={args.ranks}  "
        f"numba={'yes' if HAVE_NUMBA else 'NO (fallback only)'}"
    )

    t0 = time.perf_counter()
    warmup_numba()
    print(f"numba warm-up (compile or cache load): {time.perf_counter() - t0:.2f} s\n")

    header = (
        f"{'budget':>7} {'plan s':>7} {'py s@' + f'{args.n_fallback // 1000}k':>9} "
        f"{'mb':>6} {'naive mb':>9} {'ratio':>6} {'bound':>6} {'dummies':>8} "
        f"{'imbal':>8} {'naive imbal':>11}"
    )
    print(header)
    print("-" * len(header))
    small = lengths[: args.n_fallback]
    for budget in args.budgets:
        plan = plan_global_batch(lengths, args.ranks, budget)
        t_fast = best_of(lambda b=budget: plan_global_batch(lengths, args.ranks, b), 3)
        t_slow = best_of(
            lambda b=budget: plan_global_batch(small, args.ranks, b, use_numba=False), 1
        )
        num_micro = len(plan[0])
        dummies = sum(1 for rank in plan for mb in rank if not mb)
        loads = [sum(as_list[i] for mb in rank for i in mb) for rank in plan]
        imbalance = max(loads) / (sum(loads) / args.ranks)

        naive_ranks = [prefix_greedy(as_list[r :: args.ranks], budget) for r in range(args.ranks)]
        naive_micro = max(len(bins) for bins in naive_ranks)
        naive_loads = [sum(as_list[r :: args.ranks]) for r in range(args.ranks)]
        naive_imbalance = max(naive_loads) / (sum(naive_loads) / args.ranks)
        bound = math.ceil(total / (args.ranks * budget))
        print(
            f"{budget:>7} {t_fast:>7.3f} {t_slow:>9.3f} {num_micro:>6} {naive_micro:>9} "
            f"{naive_micro / num_micro:>6.3f} {bound:>6} {dummies:>8} "
            f"{imbalance:>8.5f} {naive_imbalance:>11.5f}"
        )
    print(
        "\nplan s: numba planner, best of 3 after warm-up;  py s: pure-Python fallback on the "
        "first samples;\nmb: micro-batches per rank;  naive: round-robin + prefix-greedy;  "
        "bound: ceil(tokens / (ranks * budget));\ndummies: empty micro-batches over all ranks;  "
        "imbal: max rank tokens / mean rank tokens\n"
    )

    # Padding: classic batching (fixed number of samples per micro-batch, in data order, each
    # padded to its longest) against the packed plan of the middle budget.
    bs = args.padded_batch_size
    padded_micro = [as_list[i : i + bs] for i in range(0, args.n, bs)]
    budget = args.budgets[len(args.budgets) // 2]
    plan = plan_global_batch(lengths, args.ranks, budget)
    packed_micro = [[as_list[i] for i in mb] for rank in plan for mb in rank]
    pad_padded = padding_fraction(padded_micro, padded=True)
    pad_packed = padding_fraction(packed_micro, padded=False)
    pad_packed_128 = padding_fraction(packed_micro, padded=False, pad_to_multiple_of=128)
    padded_positions = total / (1 - pad_padded)
    packed_positions = total / (1 - pad_packed)
    print(f"padding fraction (share of computed positions that are padding), budget={budget}:")
    print(f"  padded batching, {bs} samples/micro-batch:  {pad_padded:.3f}")
    print(f"  packed (padding-free):                  {pad_packed:.3f}")
    print(f"  packed, rows padded to multiple of 128: {pad_packed_128:.6f}")
    print(f"  computed positions padded / packed:     {padded_positions / packed_positions:.2f}x")


if __name__ == "__main__":
    main()
