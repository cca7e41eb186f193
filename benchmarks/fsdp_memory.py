"""Per-rank training-state memory of DDP vs FSDP2, and the log-prob path's memory under each.

Part 1, sharding. For each mode (``distributed="ddp"`` / ``"fsdp2"``) and world size (1, 2, 4
processes), a fresh launch trains ONE AdamW step of SFT through ``GrimoireTrainer`` on a Llama
built in code (fp32, untied embeddings). World 1 is a plain ``python`` process (FSDP2 then starts
a 1-rank gloo group); more processes run under ``python -m torch.distributed.run``. A post-hook
on the torch optimizer's ``step`` (it runs before the trainer's ``zero_grad``) inspects the live
objects on every rank:

* parameters: ``p.to_local().numel() * element_size`` for DTensors, else ``numel * element_size``;
* gradients: the same for ``p.grad``;
* optimizer state: every tensor in ``optimizer.state`` (AdamW's ``exp_avg``, ``exp_avg_sq`` and
  ``step``), local shards only.

Buffers (rotary ``inv_freq``) and DDP's gradient buckets are not counted. Each rank also reports
its process's peak RSS (``VmHWM``, for the whole process: model construction included, where
every rank still holds the full model before ``fully_shard`` splits it) and its RSS right after
the step. The table shows the largest value over a launch's ranks.

Part 2, the log-prob path. Under FSDP2 the fused chunked head gathers the LM head's weight
around its chunk loop (``grimoire.forward.head.sharded``); before that it fell back to full
logits. One process trains one step of SFT (``fused=True``) on one packed row
(``padding_free``: 4 rows of 512 tokens make a 2048-token row) under ``ddp`` and under
``fsdp2``: the path taken (a "fused log-probs off" log line means the fallback), peak RSS during
``trainer.train()``, total and above the RSS just before it.

    python benchmarks/fsdp_memory.py            # 50M-parameter model, 1/2/4 processes; minutes
    python benchmarks/fsdp_memory.py --quick    # small model, 1/2 processes; smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported as benchmarks.fsdp_memory (the repository root on sys.path)
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("ddp", "fsdp2")
MIB = 2**20

#: Model and data of the full run and of ``--quick``.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(hidden=512, layers=8, vocab=32000, worlds=(1, 2, 4), row_len=512),
    "quick": dict(hidden=128, layers=2, vocab=4096, worlds=(1, 2), row_len=128),
}
ROWS_PER_PACK = 4  # the fallback cell packs this many rows of ``row_len`` tokens into one row


# --------------------------------------------------------------------------- measuring


def local_bytes(t: Any) -> int:
    """Bytes this process holds for ``t``: its local shard for a DTensor."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: Any, optimizer: Any) -> dict[str, Any]:
    params = list({id(p): p for p in model.parameters()}.values())
    opt = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(v) for v in opt),
        "numel": sum(p.numel() for p in params),  # full (global) sizes
        "dtensors": sum(hasattr(p, "to_local") for p in params),
        "n_params": len(params),
        "grads_present": sum(p.grad is not None for p in params),
    }


def _model(preset: dict[str, Any], max_positions: int) -> Any:
    return bench.tiny_llama(preset["vocab"], preset["hidden"], preset["layers"], max_positions)


def _rows(n: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(8, vocab) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    return rows


def _config(out: str, mode: str, **kw: Any) -> Any:
    return bench.training_config(out, max_steps=1, optimizer="adamw", distributed=mode, **kw)


def run_cell(mode: str, preset: dict[str, Any], result_dir: Path) -> None:
    """One rank of a (mode, world) launch: one AdamW step, state sizes read in the step hook."""
    import torch

    from grimoire import GrimoireTrainer
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_tokenizer

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = _model(preset, 512)
    rows = _rows(2 * world, 64, preset["vocab"])
    seen: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out:
        config = _config(out, mode, batch_size=1, gradient_checkpointing=False)
        trainer = GrimoireTrainer(model, build_tokenizer(), config, SFTLoss(), rows)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            seen.update(state_bytes(trainer.model, optimizer))
            seen["rss_after_step_mb"] = bench.status_mb("VmRSS")

        inner.register_step_post_hook(after_step)
        trainer.train()
        rank = trainer.accelerator.process_index
        seen.update(
            rank=rank,
            world=trainer.accelerator.num_processes,
            steps=trainer.global_step,
            peak_rss_mb=bench.peak_mb(),
        )
        trainer.close()
    (result_dir / f"rank{rank}.json").write_text(json.dumps(seen))


class _PathLog(logging.Handler):
    """Catches the one INFO line saying the fused path is off (and why)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("fused log-probs off"):
            self.reasons.append(msg)


def run_fallback(mode: str, preset: dict[str, Any], result_dir: Path) -> None:
    """One process, one SFT step (fused=True) on one packed row: peak RSS during train()."""

    import torch

    from grimoire import GrimoireTrainer
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_tokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    catcher = _PathLog()
    log = logging.getLogger("grimoire.forward.logprobs")
    log.addHandler(catcher)
    log.setLevel(logging.INFO)
    packed = ROWS_PER_PACK * preset["row_len"]
    model = _model(preset, packed)
    rows = _rows(ROWS_PER_PACK, preset["row_len"], preset["vocab"])
    with tempfile.TemporaryDirectory() as out:
        config = _config(out, mode, batch_size=ROWS_PER_PACK, padding_free=True, max_length=packed)
        trainer = GrimoireTrainer(model, build_tokenizer(), config, SFTLoss(fused=True), rows)
        widths: list[int] = []
        inner = getattr(trainer.unwrapped_model, "model", None)
        if inner is not None:  # the decoder: record the rows x tokens of each forward
            inner.register_forward_pre_hook(
                lambda m, a, k: (
                    widths.append(int(k["input_ids"].numel()))
                    if k.get("input_ids") is not None
                    else None
                ),
                with_kwargs=True,
            )
        measured = bench.peak_during(trainer.train)
        steps = trainer.global_step
        trainer.close()
    result = {
        "mode": mode,
        **measured,
        "steps": steps,
        "tokens_per_pass": max(widths, default=0),
        "fused": not catcher.reasons,
        "reason": catcher.reasons[0] if catcher.reasons else None,
    }
    (result_dir / "fallback.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = bench.child_env()
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)  # a launcher around this driver must not leak into world 1
    return env


def _launch(kind: str, mode: str, world: int, quick: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = [str(Path(__file__).resolve()), f"--{kind}", mode, "--result-dir", tmp]
        script += ["--quick"] if quick else []
        if world == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
            cmd += ["--master-port", str(_free_port()), *script]
        t0 = time.perf_counter()
        bench.run_or_exit(cmd, f"{kind} {mode} x{world}", _env())
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]
    print(
        f"  done: {kind} {mode} x{world} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return results


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, 1 and 2 processes")
    p.add_argument("--worlds", help="comma list of process counts (default 1,2,4; quick 1,2)")
    p.add_argument("--no-fallback", action="store_true", help="skip the full-logits measurement")
    p.add_argument("--cell", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--fallback-cell", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    if args.cell:
        return run_cell(args.cell, preset, args.result_dir)
    if args.fallback_cell:
        return run_fallback(args.fallback_cell, preset, args.result_dir)

    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else list(preset["worlds"])
    t_start = time.perf_counter()
    print("# command: " + shlex.join(["python", *sys.argv]))
    print(bench.machine_line(tail="gloo backend, OMP_NUM_THREADS=1 per process"))
    print(
        f"# model: Llama hidden {preset['hidden']}, {preset['layers']} layers, vocab "
        f"{preset['vocab']} (untied), fp32; AdamW; one optimizer step of SFT through "
        "GrimoireTrainer; sizes read on each rank in the optimizer's step post-hook; "
        "max over ranks"
    )
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for world in worlds:
        for mode in MODES:
            ranks = _launch("cell", mode, world, args.quick)
            if len(ranks) != world or any(r["steps"] != 1 for r in ranks):
                sys.exit(f"{mode} x{world}: expected {world} ranks with 1 step, got {ranks}")
            row = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "rank"}
            row["total"] = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
            results[mode, world] = row
    numel = results[MODES[0], worlds[0]]["numel"]
    print(f"# parameters: {numel / 1e6:.1f}M ({numel} elements)")
    print()
    print(
        "| mode | processes | params MiB/rank | grads MiB/rank | optimizer MiB/rank "
        "| total MiB/rank | ratio vs DDP same N | peak RSS MiB/rank | RSS after step MiB/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in worlds:
        for mode in MODES:
            r = results[mode, world]
            ratio = r["total"] / results["ddp", world]["total"]
            print(
                f"| {mode} | {world} | {_mib(r['params'])} | {_mib(r['grads'])} "
                f"| {_mib(r['optimizer'])} | {_mib(r['total'])} | {ratio:.2f}x "
                f"| {r['peak_rss_mb']:.0f} | {r['rss_after_step_mb']:.0f} |",
                flush=True,
            )

    if not args.no_fallback:
        tokens = ROWS_PER_PACK * preset["row_len"]
        fb = {mode: _launch("fallback-cell", mode, 1, args.quick)[0] for mode in MODES}
        print()
        print(
            f"# log-prob path: 1 process, one SFT step (SFTLoss(fused=True)) on one packed "
            f"row of {tokens} tokens ({ROWS_PER_PACK} x {preset['row_len']}, padding_free), "
            f"vocab {preset['vocab']}, fp32, gradient checkpointing on; peak RSS during train(), "
            "'+' = above the RSS just before it"
        )
        print()
        print("| mode | log-prob path | tokens per forward | peak RSS MiB | peak above start MiB |")
        print("|---|---|---|---|---|")
        for mode in MODES:
            r = fb[mode]
            path = "fused (chunked head)" if r["fused"] else "full logits (fallback)"
            print(
                f"| {mode} | {path} | {r['tokens_per_pass']} | {r['peak_mb']:.0f} "
                f"| +{r['delta_mb']:.0f} |"
            )
        ddp, fsdp = fb["ddp"], fb["fsdp2"]
        logits = tokens * preset["vocab"] * 4 / MIB
        print()
        print(
            f"Under FSDP2 this step peaks {fsdp['delta_mb'] / max(ddp['delta_mb'], 1e-9):.2f}x "
            f"the fused path's memory above the start (+{fsdp['delta_mb']:.0f} vs "
            f"+{ddp['delta_mb']:.0f} MiB; {fsdp['delta_mb'] - ddp['delta_mb']:+.0f} MiB, where "
            f"one fp32 [{tokens} x {preset['vocab']}] logits tensor is {logits:.0f} MiB); "
            f"total peak RSS {fsdp['peak_mb'] / ddp['peak_mb']:.2f}x."
        )
        if fsdp["reason"]:
            print(f"# fsdp2 log line: {fsdp['reason']}")
    print(f"# wall time: {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
