"""``grimoire estimate-memory`` against measured peak memory, on CPU.

Each case is a ``grimoire train`` YAML config (a Llama built in code and saved, pre-tokenized or
text rows written to JSONL). The same config goes to the estimator (``plan_from_config``, as the
command reads it, with ``device="cpu"``) and to ``grimoire.cli.run.build_run``, whose trainer
then trains a few optimizer steps (``steps`` of the preset) while the peak is measured.

Measured: bytes of live tensors, not RSS (which counts the interpreter, libraries and freed
pages the allocator keeps). At the start of ``trainer.train()`` every tensor reachable from
Python is summed once per storage (model weights, buffers, a reference copy, FSDP2's shards);
from there torch's profiler reports every allocation and free of the CPU allocator
(``profile_memory=True``: the raw allocation events, so storage resizes such as FSDP2's gathers
count too), and the running sum's maximum is the peak. Under ``torch.distributed.run`` each rank
measures itself; the table shows the largest rank.

    python benchmarks/memory_estimate.py            # Llama 512 x 8, vocab 32000; minutes
    python benchmarks/memory_estimate.py --quick    # the test's small model (tests/test_estimate_memory.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported as benchmarks.memory_estimate (the repository root on sys.path)
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIB = 2**20
#: Model, micro-batch and optimizer steps of each preset. Two steps already reach the peak: the
#: second step's backward runs with the optimizer state the first step's update created.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        hidden=512, layers=8, intermediate=1376, vocab=32000, rows=4, row_len=256, steps=3
    ),
    "quick": dict(hidden=256, layers=4, intermediate=688, vocab=8192, rows=2, row_len=256, steps=2),
}
#: name -> (loss section, peft section, training overrides, processes).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any], int]] = {
    "sft": ({"type": "sft"}, None, {}, 1),
    "sft + checkpointing": ({"type": "sft"}, None, {"gradient_checkpointing": True}, 1),
    "sft + muon": ({"type": "sft"}, None, {"optimizer": "muon"}, 1),
    "lora sft": (
        {"type": "sft"},
        {"r": 16, "target_modules": "all-linear", "lora_dropout": 0.05},
        {"learning_rate": 1e-4, "disable_dropout": False},  # LoRA's dropout keeps its masks
        1,
    ),
    "dpo + reference copy": ({"type": "dpo", "ref_model": "copy"}, None, {}, 1),
    "sft fsdp2": ({"type": "sft"}, None, {"distributed": "fsdp2"}, 2),
}
QUICK_CASES = ("sft", "sft + checkpointing", "lora sft", "dpo + reference copy")


# --------------------------------------------------------------------------- measuring


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python, each storage once."""
    import torch

    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or type(obj).__name__ == "DTensor":
            continue  # a DTensor owns no storage: its local shard is found by itself
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # meta / wrapper tensors
            continue
        if storage.device.type == "cpu" and storage.data_ptr():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_tensor_bytes(fn: Any) -> tuple[int, int]:
    """``(live bytes before fn, peak live bytes during fn)`` of CPU tensors."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    base = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    level = peak = 0
    for _, size in sorted(events):
        level += size
        peak = max(peak, level)
    return base, base + peak


# --------------------------------------------------------------------------- one case


def write_case(name: str, preset: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The tiny model, the rows and the run config of case ``name`` under ``folder``."""
    from grimoire.data import tokenize_preference
    from grimoire.model.tiny import build_tokenizer, save_tiny

    loss, peft, training, _ = CASES[name]
    model = save_tiny(
        folder / "model",
        arch="llama",
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        num_layers=preset["layers"],
        intermediate_size=preset["intermediate"],
        tie_word_embeddings=False,
        max_position_embeddings=4 * preset["row_len"],
    )
    rng = random.Random(0)
    n, length = preset["rows"] * preset["steps"], preset["row_len"]
    if loss["type"] == "sft":
        rows = []
        for _ in range(n):
            ids = [rng.randrange(8, preset["vocab"]) for _ in range(length)]
            rows.append({"input_ids": ids, "labels": ids})
        tokenize: dict[str, Any] = {"type": "pretokenized"}
        max_length = length
    else:  # pairs of equal length: one padded [2B, T] forward without padding
        letters = "abcdefghijkl"
        rows = [
            {
                "prompt": "q" * 8,
                "chosen": "".join(rng.choices(letters, k=length // 2 - 12)),
                "rejected": "".join(rng.choices(letters, k=length // 2 - 12)),
            }
            for _ in range(n)
        ]
        tokenize = {"type": "preference"}
        max_length = len(tokenize_preference(rows[0], build_tokenizer())["chosen_input_ids"])
    bench_data = folder / "rows.jsonl"
    bench_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {
        "output_dir": str(folder / "out"),
        "max_steps": preset["steps"],
        "batch_size": preset["rows"],
        "max_length": max_length,
        "padding_free": False,
        "gradient_checkpointing": False,
        "optimizer": "adamw",
        "save_on_epoch_end": False,
        "seed": 0,
        **bench.TRAINING_DEFAULTS,
        **training,
    }
    return {
        "model": {"pretrained": str(model)},
        "dataset": {"jsonl": str(bench_data), "tokenize": tokenize},
        "loss": loss,
        **({"peft": peft} if peft else {}),
        "training": train,
        "save_to": False,
    }


def estimated(raw: dict[str, Any], world: int) -> dict[str, Any]:
    """The estimator's peak for ``raw`` on ``world`` CPU ranks, and its parts."""
    from grimoire.tools.memory import estimate, plan_from_config

    plan = plan_from_config(raw, world_size=world)
    est = estimate(plan.shape, plan.setup.with_(device="cpu"))
    return {
        "peak": est.peak,
        "phase": est.peak_phase,
        "parts": {p.name: p.device for p in est.parts},
    }


def measure(raw: dict[str, Any]) -> dict[str, Any]:
    """Build the run from ``raw`` and measure ``trainer.train()`` on this rank."""
    import torch

    from grimoire.cli.run import build_run

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run = build_run(raw)
    base, peak = peak_tensor_bytes(run.trainer.train)
    steps = run.trainer.global_step
    rank = run.trainer.accelerator.process_index
    run.trainer.close()
    return {"base": base, "peak": peak, "steps": steps, "rank": rank}


def run_case(name: str, preset_name: str) -> dict[str, Any]:
    """Estimate and measure case ``name`` (in a fresh process per launch)."""
    world = CASES[name][3]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        raw = write_case(name, PRESETS[preset_name], folder)
        (folder / "run.json").write_text(json.dumps(raw))
        script = [str(Path(__file__).resolve()), "--cell", str(folder)]
        cmd = bench.launch_cmd(script, world)
        env = bench.child_env()
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("WORLD_SIZE", None)
        t0 = time.perf_counter()
        bench.run_or_exit(cmd, f"case {name!r}", env)
        ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
        steps = PRESETS[preset_name]["steps"]
        if len(ranks) != world or any(r["steps"] != steps for r in ranks):
            sys.exit(f"case {name!r}: expected {world} ranks with {steps} steps, got {ranks}")
        est = estimated(raw, world)
    return {
        "case": name,
        "processes": world,
        "measured": max(r["peak"] for r in ranks),
        "estimate": est["peak"],
        "phase": est["phase"],
        "parts": est["parts"],
        "seconds": time.perf_counter() - t0,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | processes | estimate MiB/rank | measured MiB/rank | estimate / measured "
        "| estimated peak at |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['processes']} | {r['estimate'] / MIB:.1f} "
            f"| {r['measured'] / MIB:.1f} | {r['estimate'] / r['measured']:.2f} | {r['phase']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the test's small model and 4 cases")
    p.add_argument("--cases", help="comma list of case names (default: all, or the quick four)")
    p.add_argument("--cell", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        raw = json.loads((args.cell / "run.json").read_text())
        result = measure(raw)
        (args.cell / f"rank{result['rank']}.json").write_text(json.dumps(result))
        return
    preset = "quick" if args.quick else "full"
    names = args.cases.split(",") if args.cases else list(QUICK_CASES if args.quick else CASES)
    t0 = time.perf_counter()
    print("# command: " + shlex.join(["python", *sys.argv]))
    print(bench.machine_line(tail="gloo backend, OMP_NUM_THREADS=1 per process"))
    shape = PRESETS[preset]
    print(
        f"# model: Llama hidden {shape['hidden']}, {shape['layers']} layers, MLP "
        f"{shape['intermediate']}, vocab {shape['vocab']} (untied), fp32; {shape['rows']} rows x "
        f"{shape['row_len']} tokens per micro-batch (pairs: {shape['rows']} pairs); AdamW unless "
        f"named; {shape['steps']} optimizer steps; peak of live CPU tensor bytes"
    )
    results = []
    for name in names:
        results.append(run_case(name, preset))
        print(f"  done: {name} in {results[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print()
    print(table(results))
    print(f"# wall time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
