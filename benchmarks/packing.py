"""Padded vs padding-free training on a length-skewed synthetic SFT set, measured in one run.

Prints the padding fraction and trained tokens/s of both, and their ratio. Same model, same
global batches (same samples per optimizer step), same number of steps; only the micro-batch
layout differs: padded = rows padded to the longest in each micro-batch of ``--micro`` rows;
padding-free = samples packed into rows of at most ``--budget`` tokens (LPT/best-fit planner).

    python benchmarks/packing.py [--steps 6] [--global-batch 32] [--budget 4096]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def skewed_lengths(n: int, seed: int, max_len: int = 2048) -> list[int]:
    """Pareto-like lengths (alpha 1.2, scale 48), clipped to [16, max_len]: most rows short,
    a long tail up to ``max_len`` — the shape of real chat data."""
    rng = np.random.default_rng(seed)
    return np.clip((rng.pareto(1.2, n) + 1) * 48, 16, max_len).astype(int).tolist()


def run(mode: str, rows: list[dict], args, model_dir: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
    from grimoire.losses import SFTLoss

    layout = (
        dict(
            batch_size=args.micro,
            gradient_accumulation_steps=args.global_batch // args.micro,
            padding_free=False,  # the baseline (the default, auto, may pack)
        )
        if mode == "padded"
        else dict(batch_size=args.global_batch, max_tokens_per_device=args.budget)
    )
    stats = {"positions": 0, "tokens": 0, "time": 0.0}

    class Timer(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            now = time.perf_counter()
            if step > 1:  # step 1 warms up kernels and allocator; not timed
                stats["time"] += now - self.t
            self.t = now

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainingConfig(
            output_dir=out,
            max_steps=args.steps + 1,
            learning_rate=1e-4,
            mixed_precision="bf16",
            gradient_checkpointing=False,
            progress_bar=False,
            save_on_epoch_end=False,
            logging_steps=1000,
            max_length=4096,
            seed=0,
            **layout,
        )
        trainer = GrimoireTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            config=cfg,
            loss_fn=SFTLoss(),
            train_dataset=rows,
            callbacks=[Timer()],
        )
        for step in range(1, args.steps + 1):  # what the timed steps computed
            for micro in trainer.planner.plan(0, step):
                lens = [len(rows[i]["input_ids"]) for i in micro]
                stats["tokens"] += sum(lens)
                stats["positions"] += (max(lens) * len(lens)) if mode == "padded" else sum(lens)
        trainer.train()
    return {
        "padding_fraction": 1 - stats["tokens"] / stats["positions"],
        "tokens_per_sec": stats["tokens"] / stats["time"],
        "seconds": stats["time"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    from grimoire.model.tiny import save_tiny

    lengths = skewed_lengths(args.global_batch * (args.steps + 2), seed=0)
    rng = np.random.default_rng(1)
    rows = []
    for n in lengths:
        ids = rng.integers(8, 60, n).tolist()
        rows.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * n})
    with tempfile.TemporaryDirectory() as model_dir:
        save_tiny(model_dir, hidden_size=args.hidden, num_layers=2)
        res = {mode: run(mode, rows, args, model_dir) for mode in ("padded", "padding-free")}
    print(
        f"lengths: n={len(lengths)} mean={np.mean(lengths):.0f} median={np.median(lengths):.0f} "
        f"max={max(lengths)}; global batch {args.global_batch}, {args.steps} timed steps, "
        f"bf16 autocast, hidden {args.hidden}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'layout':<14}{'padding':>10}{'tokens/s':>12}{'seconds':>10}")
    for mode, r in res.items():
        print(
            f"{mode:<14}{r['padding_fraction']:>10.1%}{r['tokens_per_sec']:>12.0f}{r['seconds']:>10.1f}"
        )
    ratio = res["padding-free"]["tokens_per_sec"] / res["padded"]["tokens_per_sec"]
    print(f"padding-free / padded trained tokens/s: {ratio:.2f}x")
    planner_throughput()


def planner_throughput(n: int = 1_000_000, ranks: int = 8, budget: int = 32768) -> None:
    """Time the LPT + best-fit planner on ``n`` skewed lengths (numba, after JIT warm-up)."""
    from grimoire.batching.bin_packing import HAVE_NUMBA, plan_global_batch, warmup_numba

    lengths = skewed_lengths(n, seed=2)
    warmup_numba()
    t0 = time.perf_counter()
    plan = plan_global_batch(lengths, ranks, budget)
    dt = time.perf_counter() - t0
    loads = [sum(lengths[i] for micro in rank for i in micro) for rank in plan]
    print(
        f"planner: {n:,} lengths over {ranks} ranks, budget {budget}: {dt:.2f}s "
        f"(numba={HAVE_NUMBA}), {len(plan[0])} micro-batches per rank, "
        f"rank imbalance max/mean {max(loads) / (sum(loads) / ranks):.4f}"
    )


if __name__ == "__main__":
    main()
