"""Per-process memory and tokens/s of one long packed row under sequence parallelism (Ulysses).

One packed row of ``docs x doc_len`` tokens (3 documents of 5461: 16,383 tokens; the slice
boundaries of N = 2 and 4 fall inside documents) trains ``steps`` AdamW steps of SFT through
``GrimoireTrainer`` (padding-free, the fused chunked head, fp32, no activation checkpointing) on
a Llama built in code whose activations dwarf its weights, with
``training.sequence_parallel_size = N`` for N = 1, 2, 4 (N processes, one sequence group, gloo;
N = 1 is a plain process). The budget is per device (``max_tokens_per_device = ceil(row / N)``),
so at every N the row is ONE micro-batch and each process runs ``1/N`` of it.

Each process measures itself during ``trainer.train()``, in two launches per N:

* **memory**: the peak RSS (``VmHWM``, reset just before ``train()``: ``common.peak_during``, as
  ``benchmarks/fsdp_memory.py`` measures) above the RSS at the start, plus the live tensor bytes
  at the start (the weights: ``memory_estimate.live_tensor_bytes``): the per-process peak that
  ``grimoire estimate-memory`` predicts, printed beside it (``plan_from_config`` on the same
  settings, ``device="cpu"``). The launch runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed
  at 128 KiB: every block that large is its own mapping, returned to the system when freed, so
  the RSS follows the live tensors (with the default, growing threshold freed blocks stay in the
  heap and the 1-process RSS rise was twice its tensor peak). Torch's profiler, which
  ``memory_estimate.py`` counts tensors with, misses frees under N > 1: after ``train()`` its
  running sum ended ~100 MiB above the live tensors (at N = 1: exactly AdamW's states), frees
  made, we take it, on gloo's threads, which it does not follow.
  The whole process's peak RSS (interpreter and libraries included) is shown too.
* **time**: the same run with the default allocator; tokens/s is the row's tokens over the wall
  time of the last step (the first warms up), for the whole sequence group. 4 processes on 2
  cores share them, so the ratio there says little about a machine with a core (or a GPU) per
  process.

The *static* part is counted, not measured: weights, gradients and AdamW's two states (fp32, 4
bytes each per parameter) plus, for N > 1, DDP's gradient buckets (one more copy). It is
replicated on every process of a sequence group, so it does not fall with N; the rest of the
peak (activations, the head's chunks, attention's exchange buffers) does, as ``~1/N``.

    python benchmarks/sequence_parallel_memory.py            # 16k-token row, N = 1, 2, 4; minutes
    python benchmarks/sequence_parallel_memory.py --quick    # 2k tokens, N = 1, 2 (the test's)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported as benchmarks.sequence_parallel_memory (the repository root on sys.path)
    from benchmarks import common as bench
    from benchmarks.memory_estimate import live_tensor_bytes
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench
    from memory_estimate import live_tensor_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIB = 2**20
#: The memory launch's allocator setting (see the module docstring).
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
#: Model and row of each preset. 4 attention heads and 4 key/value heads: divisible by N = 4.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        hidden=128,
        layers=4,
        intermediate=384,
        vocab=2048,
        docs=3,
        doc_len=5461,
        steps=2,
        worlds=(1, 2, 4),
    ),
    "quick": dict(
        hidden=64,
        layers=2,
        intermediate=128,
        vocab=512,
        docs=3,
        doc_len=683,
        steps=2,
        worlds=(1, 2),
    ),
}


def model_kwargs(preset: dict[str, Any]) -> dict[str, Any]:
    """``grimoire.model.tiny`` settings of the preset's Llama."""
    return dict(
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        num_layers=preset["layers"],
        intermediate_size=preset["intermediate"],
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=preset["doc_len"],
    )


def row_tokens(preset: dict[str, Any]) -> int:
    return preset["docs"] * preset["doc_len"]


def training_settings(preset: dict[str, Any], world: int) -> dict[str, Any]:
    """The ``training:`` section both the run and the estimate read."""
    return {
        **bench.TRAINING_DEFAULTS,
        "max_steps": preset["steps"],
        "batch_size": preset["docs"],
        "max_length": preset["doc_len"],
        "padding_free": True,
        "gradient_checkpointing": False,
        "optimizer": "adamw",
        "sequence_parallel_size": world,
        # Per device: the row of ``docs x doc_len`` tokens is one micro-batch at every N.
        "max_tokens_per_device": -(-row_tokens(preset) // world),
    }


def estimated(preset: dict[str, Any], world: int) -> dict[str, float]:
    """``grimoire estimate-memory``'s peak for this run on ``world`` CPU processes, and its
    static part (weights, gradients, optimizer states, DDP's buckets)."""
    from grimoire.model.tiny import tiny_config
    from grimoire.tools.memory import estimate, plan_from_config

    with tempfile.TemporaryDirectory() as tmp:
        tiny_config("llama", **model_kwargs(preset)).save_pretrained(tmp)
        raw = {
            "model": {"pretrained": str(Path(tmp) / "config.json")},
            "loss": {"type": "sft"},
            "training": training_settings(preset, world),
        }
        plan = plan_from_config(raw, world_size=world)
    est = estimate(plan.shape, plan.setup.with_(device="cpu"))
    static = ("weights", "gradients", "optimizer states", "DDP gradient buckets")
    return {
        "peak": est.peak,
        "static": sum(p.device for p in est.parts if p.name in static),
        "rank_tokens": plan.setup.rank_tokens,
    }


# --------------------------------------------------------------------------- one process


class AfterFirstStep:
    """A trainer callback: at the end of the first step (the optimizer's states and DDP's
    buckets exist, every kernel's code has been paged in), the live tensor bytes and the RSS,
    and the RSS high-water mark reset; the later steps' peak is then ``base_tensors`` plus
    ``VmHWM - base_rss``."""

    def __init__(self) -> None:
        self.base_tensors: int | None = None
        self.base_rss_mb = 0.0

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        if self.base_tensors is None:
            self.base_tensors = live_tensor_bytes()  # collects garbage first
            self.base_rss_mb = bench.status_mb("VmRSS")
            bench.reset_peak()

    def peak(self) -> float:
        assert self.base_tensors is not None, "no step ended"
        return self.base_tensors + (bench.peak_mb() - self.base_rss_mb) * MIB

    def __getattr__(self, name: str) -> Any:  # every other hook: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def run_cell(preset: dict[str, Any], result_dir: Path) -> None:
    """This process's share of one launch: ``steps`` SFT steps on the packed row, measured."""
    import random

    import torch

    from grimoire import GrimoireTrainer
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_model, build_tokenizer

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model("llama", seed=0, **model_kwargs(preset))
    rng = random.Random(0)
    rows = []
    for _ in range(preset["docs"] * preset["steps"]):  # every document as long: any order fits
        ids = [rng.randrange(8, preset["vocab"]) for _ in range(preset["doc_len"])]
        rows.append({"input_ids": ids, "labels": ids})
    clock, memory = bench.StepClock(), AfterFirstStep()
    local: list[int] = []  # tokens the model itself is given on this process, per forward
    model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: local.append(int(args[0].shape[1]))
    )
    with tempfile.TemporaryDirectory() as out:
        config = bench.training_config(out, **training_settings(preset, world))
        trainer = GrimoireTrainer(
            model, build_tokenizer(), config, SFTLoss(), rows, callbacks=[memory, clock]
        )
        trainer.train()
        steps, rank = trainer.global_step, trainer.accelerator.process_index
        trainer.close()
    result = {
        "rank": rank,
        "steps": steps,
        "peak": memory.peak(),
        "peak_rss_mb": bench.peak_mb(),
        "last_step_s": clock.times[-1] - clock.times[-2],
        "local_tokens": max(local),
    }
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def launch(preset_name: str, world: int, extra_env: dict[str, str]) -> list[dict[str, Any]]:
    """One launch of ``world`` processes; each process's numbers."""
    preset = PRESETS[preset_name]
    with tempfile.TemporaryDirectory() as tmp:
        script = [str(Path(__file__).resolve()), "--cell", preset_name, "--result-dir", tmp]
        cmd = bench.launch_cmd(script, world)
        env = {**bench.child_env(), "OMP_NUM_THREADS": "1", **extra_env}
        env.pop("WORLD_SIZE", None)  # a launcher around this driver must not leak into world 1
        bench.run_or_exit(cmd, f"sequence_parallel_size={world}", env)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if len(ranks) != world or any(r["steps"] != preset["steps"] for r in ranks):
        sys.exit(f"N={world}: expected {world} ranks with {preset['steps']} steps, got {ranks}")
    return ranks


def run_world(preset_name: str, world: int, timed: bool = True) -> dict[str, Any]:
    """The memory launch (and, ``timed``, the time launch) of ``world`` processes, with the
    estimate beside them: the largest process's numbers."""
    t0 = time.perf_counter()
    ranks = launch(preset_name, world, MEMORY_ENV)
    row: dict[str, Any] = {k: max(r[k] for r in ranks) for k in ("peak", "peak_rss_mb")}
    row["local_tokens"] = max(r["local_tokens"] for r in ranks)
    if timed:
        last_step = max(r["last_step_s"] for r in launch(preset_name, world, {}))
        row["tokens_per_s"] = row_tokens(PRESETS[preset_name]) / last_step
    est = estimated(PRESETS[preset_name], world)
    row.update(world=world, seconds=time.perf_counter() - t0, estimate=est["peak"])
    row.update(static=est["static"], estimated_rank_tokens=est["rank_tokens"])
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: per-process peaks, their part above the static one, tokens/s, the
    estimate; ratios against the first row (N = 1) of the same run."""
    one = rows[0]
    lines = [
        "| N | tokens per process | peak MiB/process | x N=1 | static MiB (replicated) "
        "| peak - static MiB | x N=1 | whole-process peak RSS MiB | tokens/s (group) | x N=1 "
        "| estimate MiB | estimate / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dynamic, dynamic_one = r["peak"] - r["static"], one["peak"] - one["static"]
        speed = "- | -"
        if "tokens_per_s" in r:
            speed = f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one['tokens_per_s']:.2f}"
        lines.append(
            f"| {r['world']} | {r['local_tokens']} | {r['peak'] / MIB:.0f} "
            f"| {r['peak'] / one['peak']:.2f} | {r['static'] / MIB:.1f} "
            f"| {dynamic / MIB:.0f} | {dynamic / dynamic_one:.2f} | {r['peak_rss_mb']:.0f} "
            f"| {speed} | {r['estimate'] / MIB:.0f} "
            f"| {r['estimate'] / r['peak']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2k-token row, small model, N = 1, 2")
    p.add_argument("--worlds", help="comma list of N (default 1,2,4; quick 1,2); 1 comes first")
    p.add_argument("--cell", choices=list(PRESETS), help=argparse.SUPPRESS)
    p.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        return run_cell(PRESETS[args.cell], args.result_dir)
    name = "quick" if args.quick else "full"
    preset = PRESETS[name]
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else list(preset["worlds"])
    t0 = time.perf_counter()
    print("# command: " + shlex.join(["python", *sys.argv]))
    print(bench.machine_line(tail="gloo backend, OMP_NUM_THREADS=1 per process"))
    print(
        f"# model: Llama hidden {preset['hidden']}, {preset['layers']} layers, 4 heads / 4 KV, "
        f"MLP {preset['intermediate']}, vocab {preset['vocab']} (untied), fp32; one packed row of "
        f"{preset['docs']} x {preset['doc_len']} = {row_tokens(preset)} tokens per step; SFT, "
        f"AdamW, {preset['steps']} steps, no checkpointing, fused head; max over processes"
    )
    rows = []
    for world in worlds:
        rows.append(run_world(name, world))
        print(f"  done: N={world} in {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print()
    print(table(rows))
    print(f"# wall time: {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
