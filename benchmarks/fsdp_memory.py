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

Part 2, the log-prob path at a 128k vocabulary. Under FSDP2 the fused chunked head gathers the
LM head's weight around its chunk loop (``grimoire.forward.head.sharded``); before that, FSDP2
fell back to full logits. Two processes each train one step of SFT on one packed row
(``padding_free``: 4 rows of 512 tokens make a 2048-token row), vocabulary 128,256, under
``ddp`` (fused), ``fsdp2`` (fused) and ``fsdp2`` with ``fused=False`` (the old fallback's full
logits): the largest logits block any op produced (a TorchDispatchMode), peak RSS during
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
    "full": dict(
        hidden=512,
        layers=8,
        vocab=32000,
        worlds=(1, 2, 4),
        row_len=512,
        logits_vocab=128256,
        chunk=1024,
    ),
    "quick": dict(
        hidden=128, layers=2, vocab=4096, worlds=(1, 2), row_len=128, logits_vocab=4096, chunk=128
    ),
}
ROWS_PER_PACK = 4  # part 2 packs this many rows of ``row_len`` tokens into one row per rank


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


#: Part 2's cells: (mode, fused). ``fsdp2`` with ``fused=False`` is the full-logits path FSDP2
#: took for every method before the fused head learned to gather its weight (the old fallback).
LOGIT_CELLS = {
    "ddp-fused": ("ddp", True),
    "fsdp2-fused": ("fsdp2", True),
    "fsdp2-full": ("fsdp2", False),
}


def run_logits(cell: str, preset: dict[str, Any], result_dir: Path) -> None:
    """One rank of a 2-process launch: one SFT step on one packed row; the largest logits block
    (a dispatch mode) and the peak RSS during train()."""
    import torch

    from grimoire import GrimoireTrainer
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_tokenizer

    mode, fused = LOGIT_CELLS[cell]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    catcher = _PathLog()
    log = logging.getLogger("grimoire.forward.logprobs")
    log.addHandler(catcher)
    log.setLevel(logging.INFO)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    packed, vocab = ROWS_PER_PACK * preset["row_len"], preset["logits_vocab"]
    model = bench.tiny_llama(vocab, preset["hidden"], preset["layers"], packed)
    rows = _rows(ROWS_PER_PACK * world, preset["row_len"], vocab)
    with tempfile.TemporaryDirectory() as out:
        config = _config(out, mode, batch_size=ROWS_PER_PACK, padding_free=True, max_length=packed)
        loss = SFTLoss(fused=fused, fused_chunk_size=preset["chunk"])
        trainer = GrimoireTrainer(model, build_tokenizer(), config, loss, rows)
        peak = bench.vocab_peak(vocab)
        with peak:
            measured = bench.peak_during(trainer.train)
        steps, rank = trainer.global_step, trainer.accelerator.process_index
        trainer.close()
    result = {
        "cell": cell,
        "rank": rank,
        **measured,
        "steps": steps,
        "logit_rows": peak.rows,
        "fused": fused and not catcher.reasons,
        "reason": catcher.reasons[0] if catcher.reasons else None,
    }
    (result_dir / f"logits.rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def _env() -> dict[str, str]:
    env = bench.child_env()
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)  # a launcher around this driver must not leak into world 1
    return env


def _launch(kind: str, mode: str, world: int, quick: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = [str(Path(__file__).resolve()), f"--{kind}", mode, "--result-dir", tmp]
        script += ["--quick"] if quick else []
        cmd = bench.launch_cmd(script, world)
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
    p.add_argument("--no-logits", action="store_true", help="skip part 2 (the log-prob path)")
    p.add_argument(
        "--logits-cells",
        default=",".join(LOGIT_CELLS),
        help=f"part 2's cells, comma list (default all: {','.join(LOGIT_CELLS)})",
    )
    p.add_argument("--cell", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--logits-cell", choices=list(LOGIT_CELLS), help=argparse.SUPPRESS)
    p.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    if args.cell:
        return run_cell(args.cell, preset, args.result_dir)
    if args.logits_cell:
        return run_logits(args.logits_cell, preset, args.result_dir)

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

    if not args.no_logits:
        tokens, vocab = ROWS_PER_PACK * preset["row_len"], preset["logits_vocab"]
        cells = {}
        for cell in args.logits_cells.split(","):
            if cell not in LOGIT_CELLS:
                sys.exit(f"--logits-cells: {cell!r} is not one of {', '.join(LOGIT_CELLS)}")
            ranks = _launch("logits-cell", cell, 2, args.quick)
            if len(ranks) != 2 or any(r["steps"] != 1 for r in ranks):
                sys.exit(f"{cell}: expected 2 ranks with 1 step, got {ranks}")
            cells[cell] = ranks
        print()
        print(
            f"# log-prob path: 2 processes, one SFT step on one packed row of {tokens} tokens "
            f"per rank ({ROWS_PER_PACK} x {preset['row_len']}, padding_free), vocab {vocab}, "
            f"fp32, fused chunk {preset['chunk']} rows, gradient checkpointing on; 'largest "
            "logits block' = the most rows of any [*, V] float tensor an op returned (a "
            "TorchDispatchMode); peak RSS during train(), '+' = above the RSS just before it; "
            "max over ranks. fsdp2 fused=False is the full-logits path FSDP2 used to fall back to"
        )
        print()
        print(
            "| mode | log-prob path | largest logits block (rows x V) | logits block MiB "
            "| peak RSS MiB/rank | peak above start MiB/rank |"
        )
        print("|---|---|---|---|---|---|")
        for cell, ranks in cells.items():
            mode, _ = LOGIT_CELLS[cell]
            rows = max(r["logit_rows"] for r in ranks)
            path = "fused (chunked head)" if all(r["fused"] for r in ranks) else "full logits"
            print(
                f"| {mode} | {path} | {rows} x {vocab} | {rows * vocab * 4 / MIB:.0f} "
                f"| {max(r['peak_mb'] for r in ranks):.0f} "
                f"| +{max(r['delta_mb'] for r in ranks):.0f} |"
            )
        if not {"fsdp2-fused", "fsdp2-full"} - set(cells):  # (--logits-cells may leave one out)
            _compare_fused(cells)
    print(f"# wall time: {time.perf_counter() - t_start:.0f} s", flush=True)


def _compare_fused(cells: dict[str, list[dict[str, Any]]]) -> None:
    """Part 2's closing line: FSDP2's fused path against its old full-logits fallback."""
    fused, full = (max(r["delta_mb"] for r in cells[c]) for c in ("fsdp2-fused", "fsdp2-full"))
    print()
    print(
        f"FSDP2 fused vs the old full-logits fallback: peak above start {fused:.0f} vs "
        f"{full:.0f} MiB per rank ({fused / max(full, 1e-9):.2f}x); total peak RSS "
        f"{max(r['peak_mb'] for r in cells['fsdp2-fused']):.0f} vs "
        f"{max(r['peak_mb'] for r in cells['fsdp2-full']):.0f} MiB."
    )
    for r in cells["fsdp2-fused"]:
        if r["reason"]:
            print(f"# fsdp2 rank {r['rank']} log line: {r['reason']}")


if __name__ == "__main__":
    main()
