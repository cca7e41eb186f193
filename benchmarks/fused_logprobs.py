"""Fused (chunked LM head) vs full-logits log-probs: peak memory and fwd+bwd step time.

Each (vocab, path) configuration runs in a fresh subprocess, so the numbers of one cannot leak
into another (allocator caches, high-water marks). Memory:

* CPU: the process's peak resident set size (``VmHWM``), reset just before the timed steps via
  ``/proc/self/clear_refs`` so model construction does not count. We report the peak *above*
  the baseline (weights, inputs, interpreter) and the total.
* CUDA: ``torch.cuda.max_memory_allocated`` (reset before the steps), minus the allocated
  baseline, and the total.

Step time: median over ``--repeats`` forward+backward steps after one warm-up step, under bf16
autocast (CPU: AMX bf16 matmuls; CUDA: the usual). Ratios are fused / full from the same run.

    python benchmarks/fused_logprobs.py                     # CPU, vocab 32k / 128k / 256k
    python benchmarks/fused_logprobs.py --device cuda --batch 4 --hidden 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

try:  # imported as benchmarks.fused_logprobs (the repository root on sys.path)
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import common as bench


def worker(args: argparse.Namespace) -> dict:
    """One configuration in this (fresh) process.

    ``--measure memory``: one path's peak memory. ``--measure time``: both paths' step times,
    interleaved (full, fused, full, fused, ...) so load from other processes on a shared machine
    hits both alike; the reported time is each path's median.
    """
    import torch

    from grimoire.forward.logprobs import compute_token_logps

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = bench.tiny_llama(args.vocab, args.hidden, args.layers, max(args.seq_len, 512)).to(
        device
    )
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    labels = ids.clone()
    # Prompt tokens (the first 1 - trained_frac of each row) get no loss, as in SFT / DPO.
    labels[:, : int(args.seq_len * (1 - args.trained_frac))] = -100

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(fused: bool) -> float:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = compute_token_logps(model, ids, labels, fused=fused, chunk_size=args.chunk_size)
            loss = -out.logps.sum() / out.mask.sum()
        loss.backward()
        sync()
        return time.perf_counter() - t0

    if args.measure == "time":
        step(False), step(True)  # warm-up: allocator, kernel selection, the fused self-check
        times: dict[str, list[float]] = {"full": [], "fused": []}
        for _ in range(args.repeats):
            times["full"].append(step(False))
            times["fused"].append(step(True))
        return {k: statistics.median(v) for k, v in times.items()}

    fused = args.path == "fused"
    step(fused)  # warm-up
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        import gc

        gc.collect()
        base = bench.status_mb("VmRSS")
        if not bench.reset_peak():
            print("warning: cannot reset peak RSS; it includes model construction", file=sys.stderr)
    step(fused)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else bench.peak_mb()
    return {"base_mb": base, "peak_mb": peak, "delta_mb": peak - base}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocabs", default="32000,128000,256000")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--trained-frac", type=float, default=1.0, help="share of tokens with a loss")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    # internal: one configuration in this process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=32000, help=argparse.SUPPRESS)
    p.add_argument("--path", default="fused", choices=["fused", "full"], help=argparse.SUPPRESS)
    p.add_argument(
        "--measure", default="memory", choices=["memory", "time"], help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return

    common = [
        f"--seq-len={args.seq_len}",
        f"--batch={args.batch}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--chunk-size={args.chunk_size}",
        f"--trained-frac={args.trained_frac}",
        f"--repeats={args.repeats}",
        f"--threads={args.threads}",
        f"--device={args.device}",
    ]
    mem = "peak RSS" if args.device == "cpu" else "max allocated"
    print(
        f"# device={args.device} batch={args.batch} seq={args.seq_len} hidden={args.hidden} "
        f"layers={args.layers} chunk={args.chunk_size} trained_frac={args.trained_frac} "
        f"threads={args.threads} repeats={args.repeats} bf16 autocast; memory = {mem}, "
        "'+' = above the post-warm-up baseline (weights, inputs)"
    )
    header = (
        "| vocab | full peak MiB (+) | fused peak MiB (+) | mem ratio total (+) "
        "| full step s | fused step s | time ratio |"
    )
    print(header)
    print("|" + "---|" * 7)
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        res: dict[str, dict] = {}
        base_cmd = [sys.executable, __file__, "--worker", f"--vocab={vocab}", *common]
        for name, extra in (
            ("full", ["--measure=memory", "--path=full"]),
            ("fused", ["--measure=memory", "--path=fused"]),
            ("time", ["--measure=time"]),
        ):
            out = bench.run_or_exit(base_cmd + extra, f"vocab={vocab} {name}", brief=False)
            res[name] = bench.last_json(out.stdout)
        full, fused = res["full"], res["fused"]
        full["step_s"], fused["step_s"] = res["time"]["full"], res["time"]["fused"]
        print(
            f"| {vocab // 1000}k | {full['peak_mb']:.0f} (+{full['delta_mb']:.0f}) "
            f"| {fused['peak_mb']:.0f} (+{fused['delta_mb']:.0f}) "
            f"| {fused['peak_mb'] / full['peak_mb']:.2f} "
            f"({fused['delta_mb'] / max(full['delta_mb'], 1e-9):.2f}) "
            f"| {full['step_s']:.2f} | {fused['step_s']:.2f} "
            f"| {fused['step_s'] / full['step_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
