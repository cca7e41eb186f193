"""Peak memory under ``max_tokens_per_device`` vs padded micro-batches, per method family.

SFT, DPO (live reference model), KTO (live reference) and GRPO (``num_generations=4``, short
``max_new_tokens``, ``beta > 0`` so a reference pass runs) train a few optimizer steps on the
SAME long-tailed synthetic data (most rows short, a few whose unit, the tokens the row puts into
one forward pass, is near the largest budget). Paths: padded (no budget: ``batch_size`` rows per
micro-batch, padded to the longest) and each budget (``truncate_long_samples=True``: at the
smaller budgets the long rows are cut to fit, which is what a user with such data must do).

Each (family, path) cell runs in a fresh subprocess (``--cell FAMILY PATH``). Memory is the
process's peak resident set size during ``trainer.train()`` above its RSS just before it, after
model, reference model, data and trainer set-up: the high-water mark (``VmHWM``) is reset then
through ``/proc/self/clear_refs`` (fallback: ``ru_maxrss``, which then includes set-up). It
includes gradients and the AdamW state created at the first optimizer step (fixed costs that
do not change with the budget). A forward pre-hook on the decoder of the policy and of the
reference records every pass's ``rows x (cached + new)`` tokens, padding included; the table
shows the largest.

    python benchmarks/token_budget_memory.py                       # full run, several minutes
    python benchmarks/token_budget_memory.py --families sft,grpo
    python benchmarks/token_budget_memory.py --quick --jobs 2      # tiny smoke test
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:  # imported as benchmarks.token_budget_memory (the repository root on sys.path)
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
FAMILIES = ("sft", "dpo", "kto", "grpo")
IGNORE = -100
FIRST_ID = 8  # token ids below are the tiny tokenizer's special tokens

#: Long-tailed unit sizes as fractions of the largest budget (16 rows = 2 steps of 8): two rows
#: near the largest budget, one mid-sized, the rest short.
SHAPE = (
    0.97,
    0.88,
    0.37,
    0.17,
    0.11,
    0.078,
    0.0625,
    0.049,
    0.039,
    0.031,
    0.027,
    0.023,
    0.0195,
    0.0156,
    0.0117,
    0.0098,
)

#: Settings of the full run and of ``--quick``.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        hidden=256,
        layers=4,
        vocab=8192,
        budgets=(1024, 2048, 4096),
        max_steps=2,
        max_new_tokens=32,
    ),
    "quick": dict(
        hidden=64,
        layers=2,
        vocab=512,
        budgets=(256, 512),
        max_steps=1,
        max_new_tokens=8,
    ),
}


# --------------------------------------------------------------------------- data


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(max(1, n))]


def unit_sizes(top: int, n: int = len(SHAPE)) -> list[int]:
    """``n`` rows' unit costs for a data set whose longest unit is near ``top`` tokens (fewer
    than ``len(SHAPE)`` rows take every other one, keeping the longest)."""
    shape = SHAPE[:: max(1, len(SHAPE) // n)][:n]
    return [max(16, round(f * top)) for f in shape]


def make_rows(
    family: str, top: int, vocab: int, max_new_tokens: int, n: int = len(SHAPE)
) -> list[dict[str, Any]]:
    """The family's rows; every row's unit (as the budget counts it) is about ``unit_sizes``."""
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for i, unit in enumerate(unit_sizes(top, n)):
        if family == "sft":
            ids = _ids(rng, unit, vocab)
            k = min(len(ids) // 4, top // 32)  # prompt tokens: no loss
            rows.append({"input_ids": ids, "labels": [IGNORE] * k + ids[k:]})
        elif family == "dpo":
            # unit = chosen + rejected (packed); the prompt stays short enough that a pair cut
            # to the smallest budget keeps trained tokens on both sides.
            prompt = _ids(rng, min(unit // 8, top // 32), vocab)
            chosen_len = (unit - 2 * len(prompt)) // 2
            row: dict[str, Any] = {}
            for side, n in (("chosen_", chosen_len), ("rejected_", chosen_len * 9 // 10)):
                resp = _ids(rng, n, vocab)
                ids = prompt + resp
                row[f"{side}input_ids"] = ids
                row[f"{side}attention_mask"] = [1] * len(ids)
                row[f"{side}labels"] = [IGNORE] * len(prompt) + resp
            rows.append(row)
        elif family == "kto":
            # unit = the row + its mismatched KL row = 2 x the row.
            ids = _ids(rng, unit // 2, vocab)
            k = min(len(ids) // 4, top // 64)
            rows.append(
                {
                    "input_ids": ids,
                    "attention_mask": [1] * len(ids),
                    "labels": [IGNORE] * k + ids[k:],
                    "label": i % 2 == 0,
                }
            )
        elif family == "grpo":
            # unit = num_generations x (prompt + max_new_tokens), num_generations = 4.
            ids = _ids(rng, unit // 4 - max_new_tokens, vocab)
            rows.append(
                {
                    "prompt_input_ids": ids,
                    "prompt_attention_mask": [1] * len(ids),
                    "prompt": f"p{i}",
                }
            )
        else:
            raise ValueError(family)
    return rows


_REWARD_RNG = random.Random(0)


def random_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Distinct rewards (no tied groups, so every group trains); content does not matter here."""
    return [_REWARD_RNG.random() for _ in completions]


# --------------------------------------------------------------------------- one cell


class LargestPass:
    """Forward pre-hook on a decoder: the largest ``rows x (cached + new)`` tokens seen."""

    def __init__(self) -> None:
        self.largest = 0
        self.passes = 0

    def attach(self, model: Any) -> None:
        model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:  # inputs_embeds
            rows, width = kwargs["inputs_embeds"].shape[:2]
        else:
            rows, width = ids.shape
        past = kwargs.get("past_key_values")
        cached = int(past.get_seq_length()) if past is not None else 0
        self.largest = max(self.largest, rows * (cached + width))
        self.passes += 1


def run_cell(family: str, path: str, preset: dict[str, Any], args: argparse.Namespace) -> dict:
    """Train one (family, path) cell in this process and measure it."""
    import torch

    from grimoire import GrimoireTrainer
    from grimoire.batching.bin_packing import warmup_numba
    from grimoire.losses import DPOLoss, KTOLoss, SFTLoss
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import build_tokenizer

    torch.set_num_threads(args.threads)
    budget = None if path == "padded" else int(path)
    top = max(preset["budgets"])
    new = preset["max_new_tokens"]
    model = bench.tiny_llama(preset["vocab"], preset["hidden"], preset["layers"], 2 * top)
    params = sum(p.numel() for p in model.parameters())
    ref = copy.deepcopy(model).eval() if family in ("dpo", "kto", "grpo") else None
    probe = LargestPass()
    for m in (model, ref):
        if m is not None:
            probe.attach(m)
    if family == "sft":
        loss: Any = SFTLoss()
    elif family == "dpo":
        loss = DPOLoss(ref_model=ref)
    elif family == "kto":
        loss = KTOLoss(ref_model=ref)
    else:
        loss = GRPOMethod(
            reward_funcs=random_reward,
            num_generations=4,
            max_new_tokens=new,
            beta=0.04,
            ref_model=ref,
        )
    n_rows = min(len(SHAPE), args.batch_size * preset["max_steps"])  # every row trains
    rows = make_rows(family, top, preset["vocab"], new, n_rows)
    with tempfile.TemporaryDirectory() as out:
        config = bench.training_config(
            out,
            num_epochs=1,
            max_steps=preset["max_steps"],
            batch_size=args.batch_size,
            gradient_checkpointing=args.gradient_checkpointing,
            max_length=2 * top,
            max_tokens_per_device=budget,
            padding_free=budget is not None,  # the padded baseline stays padded (auto may pack)
            truncate_long_samples=budget is not None,
        )
        trainer = GrimoireTrainer(model, build_tokenizer(), config, loss, rows)
        # The budget planner's numba kernel is imported and loaded lazily at the first step: a
        # one-off cost of the budget path that does not scale with anything. Load it here, in
        # every cell, so the baseline holds it; its size is reported separately.
        gc.collect()
        before = bench.status_mb("VmRSS")
        warmup_numba()
        probe.largest, probe.passes = 0, 0
        measured = bench.peak_during(trainer.train)
        steps = trainer.global_step
    return {
        "family": family,
        "path": path,
        "largest_pass": probe.largest,
        "passes": probe.passes,
        **measured,
        "steps": steps,
        "params": params,
        "numba_mb": measured["base_mb"] - before,
    }


# --------------------------------------------------------------------------- driver


def _label(path: str) -> str:
    if path == "padded":
        return "padded"
    n = int(path)
    return f"budget {n // 1024}k" if n % 1024 == 0 else f"budget {n}"


def _cell_subprocess(family: str, path: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", family, path]
    cmd += [f"--batch-size={args.batch_size}", f"--threads={args.threads}"]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    out = bench.run_or_exit(cmd, f"cell {family} {path}", bench.child_env(repo_first=False))
    result = bench.last_json(out.stdout)
    print(
        f"  done: {family} {_label(path)}: +{result['delta_mb']:.0f} MiB, "
        f"largest pass {result['largest_pass']}, {result['seconds']:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--families", default=",".join(FAMILIES), help="comma list of " + "/".join(FAMILIES)
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows (prompts) per optimizer step")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--jobs", type=int, default=1, help="cells run at once (memory is per process)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 budgets, 1 step")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cell", nargs=2, metavar=("FAMILY", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]

    if args.cell:
        print(json.dumps(run_cell(args.cell[0], args.cell[1], preset, args)))
        return

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    paths = ["padded", *(str(b) for b in preset["budgets"])]
    top = max(preset["budgets"])
    print("# command: " + shlex.join(["python", *sys.argv]))
    print(bench.machine_line(f" ({args.threads} torch threads)", cpu_capability=True))
    print(
        f"# model: Llama hidden {preset['hidden']}, {preset['layers']} layers, vocab "
        f"{preset['vocab']} (untied), fp32, no gradient checkpointing"
        if not args.gradient_checkpointing
        else f"# model: Llama hidden {preset['hidden']}, {preset['layers']} layers, vocab "
        f"{preset['vocab']} (untied), fp32, gradient checkpointing"
    )
    units = unit_sizes(top, min(len(SHAPE), args.batch_size * preset["max_steps"]))
    print(
        f"# data: {len(units)} rows per family, units (tokens per forward pass) "
        f"{min(units)}-{max(units)}, median {sorted(units)[len(units) // 2]}; "
        f"batch_size {args.batch_size}; "
        f"max_steps {preset['max_steps']}; GRPO G=4, max_new_tokens {preset['max_new_tokens']}, "
        "beta 0.04; budgets use truncate_long_samples=True"
    )
    print(
        "# memory: peak RSS during train() above the RSS after set-up (weights, reference, data); "
        "largest pass: max rows x (cached + new) tokens of any decoder forward (policy or reference)"
    )
    print()
    print(
        "| family | path | largest pass (tokens) | peak memory above baseline (MiB) "
        "| ratio vs padded | baseline RSS (MiB) | forward passes | train s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    t_start = time.perf_counter()
    cells = [(f, path) for f in families for path in paths]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda c: _cell_subprocess(c[0], c[1], args), cells))
    by_cell = {(r["family"], r["path"]): r for r in results}
    for family in families:
        padded = by_cell[(family, "padded")]["delta_mb"]
        for path in paths:
            r = by_cell[(family, path)]
            ratio = r["delta_mb"] / padded if padded > 0 else float("nan")
            print(
                f"| {family} | {_label(path)} | {r['largest_pass']} | {r['delta_mb']:.0f} "
                f"| {ratio:.2f}x | {r['base_mb']:.0f} | {r['passes']} | {r['seconds']:.1f} |",
                flush=True,
            )
    if not all(r["peak_reset"] for r in results):
        print("\nwarning: peak RSS could not be reset; the peaks include set-up")
    params = results[0]["params"] if results else 0
    numba = max((r["numba_mb"] for r in results), default=0.0)
    print(
        f"\nparams per model: {params / 1e6:.2f} M ({params * 4 / 2**20:.0f} MiB fp32); gradients "
        f"+ AdamW state add about {3 * params * 4 / 2**20:.0f} MiB to every row's peak. Loading "
        f"the planner's numba kernel (in the baseline) took up to {numba:.0f} MiB. "
        f"Total wall time {time.perf_counter() - t_start:.0f} s."
    )


if __name__ == "__main__":
    main()
