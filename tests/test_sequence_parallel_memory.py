"""Sequence parallelism's memory side: the token budget per device and ``estimate-memory``.

* The budget (``max_tokens_per_device``) stays per device: a row split over a sequence group of
  ``N`` may hold ``N`` times it. Checked on the planner and the budget's checks, no processes;
  the step's rows, and so its loss units (what the loss is normalised by), do not change.
* The estimate splits a row's activations and logits over ``N`` and replicates the rest: checked
  by arithmetic against the one-process estimate of a ``1/N`` row, through the run config, and
  against one short 2-process measurement (``benchmarks/sequence_parallel_memory.py --quick``).
"""

from __future__ import annotations

import pytest

from grimoire.batching.budget import TokenBudget
from grimoire.batching.loader import StepLoader
from grimoire.columns import IGNORE_INDEX
from grimoire.config.model_shape import ModelShape
from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.tools.memory import Setup, estimate, plan_from_config
from grimoire.training.setup import build_budget

SMALL = ModelShape(
    hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100
)


def _rows(lengths: list[int]) -> list[dict[str, list[int]]]:
    """SFT rows of these lengths; each row's first token untrained, ids telling rows apart."""
    return [
        {"input_ids": [i + 8] * n, "labels": [IGNORE_INDEX] + [i + 8] * (n - 1)}
        for i, n in enumerate(lengths)
    ]


# --------------------------------------------------------------------------- the token budget


def test_sequence_parallel_budget_is_per_device():
    budget = build_budget(
        TrainingConfig(max_tokens_per_device=100, sequence_parallel_size=4, padding_free=True),
        SFTLoss(),
        packed=True,
    )
    assert budget is not None and (budget.max_tokens, budget.row_tokens) == (100, 400)
    one = build_budget(TrainingConfig(max_tokens_per_device=100), SFTLoss(), packed=True)
    assert one is not None and one.row_tokens == 100


def test_sequence_parallel_budget_admits_and_refuses_rows_by_the_group():
    rows = _rows([150, 250])
    split = TokenBudget(100, SFTLoss(), packed=True, sequence_parallel=2)
    problems = split.problems(rows, "train")
    # 150 tokens are 75 per device: fit. 250 are 125 per device: over, named with the group.
    assert len(problems) == 1 and problems[0].startswith("train row 1: needs 250 tokens")
    assert "max_tokens_per_device=100 x sequence_parallel_size=2 = 200 per row" in problems[0]
    alone = TokenBudget(100, SFTLoss(), packed=True)
    assert len(alone.problems(rows, "train")) == 2  # one device: both over
    cut = TokenBudget(100, SFTLoss(), packed=True, truncate=True, sequence_parallel=2)
    assert len(cut.fit(rows[1])["input_ids"]) == 200  # cut to the group's row, not to 100
    assert cut.costs(rows) == [150, 200]


def _plan(budget: TokenBudget, rows: list[dict]) -> list[list[int]]:
    loader = StepLoader.build(
        rows, SFTLoss().create_packed_collator(0), budget, batch_size=6, world_size=1, rank=0
    )
    return loader.planner.plan(0, 0)


def test_sequence_parallel_planner_bins_rows_by_the_group_budget():
    lengths = [90, 60, 120, 40, 150, 70]
    rows = _rows(lengths)
    alone = _plan(TokenBudget(160, SFTLoss(), packed=True), rows)
    split = _plan(TokenBudget(160, SFTLoss(), packed=True, sequence_parallel=2), rows)
    for plan, limit in ((alone, 160), (split, 320)):
        assert all(sum(lengths[i] for i in micro) <= limit for micro in plan)
    # 530 tokens: at least 4 micro-batches of <= 160 alone, 2 of <= 320 over two devices.
    assert len(alone) >= 4 and len(split) == 2
    # The same rows train in the step, each once: the step's loss units (trained tokens, what
    # the token-mean loss is divided by) are the same whatever the budget packs per micro-batch.
    assert sorted(i for m in alone for i in m) == sorted(i for m in split for i in m) == [*range(6)]
    collate = SFTLoss().create_packed_collator(0)

    def units(plan: list[list[int]]) -> int:
        return sum(
            int((collate([rows[i] for i in m])["labels"] != IGNORE_INDEX).sum()) for m in plan
        )

    assert units(alone) == units(split) == sum(n - 1 for n in lengths)


# --------------------------------------------------------------------------- the estimate


def test_sequence_parallel_estimate_splits_activations_and_replicates_state():
    row = Setup(weight_dtype="float32", checkpointing=False, tokens=1001, device="cpu")
    split = estimate(SMALL, row.with_(world_size=2, sequence_parallel=2))
    # Each rank runs ceil(1001 / 2) = 501 positions: its activations and logits are those of a
    # 501-token micro-batch on a 2-process DDP run; weights, gradients, AdamW and DDP's buckets
    # are the full copies of any 2-process DDP run.
    assert split.setup.rank_tokens == 501
    half = estimate(SMALL, row.with_(world_size=2, tokens=501))
    assert {p.name: p.device for p in split.parts} == {p.name: p.device for p in half.parts}
    assert split.phases == half.phases
    whole = estimate(SMALL, row.with_(world_size=2))
    for name in ("weights", "gradients", "optimizer states", "DDP gradient buckets"):
        assert split.part(name).device == whole.part(name).device
    assert split.part("activations").device < whole.part("activations").device / 1.9


def test_sequence_parallel_estimate_reads_the_run_config():
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "loss": {"type": "sft"},
        "training": {
            "sequence_parallel_size": 2,
            "padding_free": True,
            "max_tokens_per_device": 4096,
        },
    }
    setup = plan_from_config(raw, world_size=2).setup
    # The budget is per device: the row holds 2 x 4096 tokens, each rank runs 4096 of them.
    assert (setup.sequence_parallel, setup.tokens, setup.rank_tokens) == (2, 8192, 4096)
    del raw["training"]["max_tokens_per_device"]
    raw["training"].update(batch_size=3, max_length=64)
    setup = plan_from_config(raw, world_size=4).setup
    assert (setup.tokens, setup.rank_tokens) == (192, 96)
    with pytest.raises(
        ConfigError, match="sequence_parallel_size=2 does not divide --world-size 3"
    ):
        plan_from_config(raw, world_size=3)


def test_sequence_parallel_estimate_memory_command_says_so(capsys):
    from grimoire.cli.main import main as grimoire_main

    args = ["estimate-memory", "--model", "tiny:llama", "--world-size", "4"]
    args += ["--set", "training.sequence_parallel_size=2", "--set", "training.padding_free=true"]
    args += ["--set", "training.max_tokens_per_device=1000"]
    assert grimoire_main(args) == 0
    out = capsys.readouterr().out
    assert "2000 tokens per micro-batch; each row split over 2 ranks" in out
    assert "(sequence parallel: 1000 tokens per rank)" in out
    assert "max_tokens_per_device 1000 per device x sequence_parallel_size 2" in out


def test_sequence_parallel_estimate_within_15_percent_of_two_processes():
    """One short 2-process run of the benchmark's quick preset (a 2049-token row)."""
    from benchmarks import sequence_parallel_memory as bench

    row = bench.run_world("quick", 2, timed=False)
    assert row["local_tokens"] == row["estimated_rank_tokens"] == 1025  # each ran its half
    ratio = row["estimate"] / row["peak"]
    assert 0.85 <= ratio <= 1.15, f"estimate / measured = {ratio:.2f}\n{bench.table([row])}"
