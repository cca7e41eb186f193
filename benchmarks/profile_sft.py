"""Where an SFT step's time goes, padded against packed: the workload of throughput.py.

Run: ``python benchmarks/profile_sft.py`` (about a minute on one core).

Each layout trains in this process (``--steps`` optimizer steps, the first ``--warmup`` not
counted) with wall-clock timers wrapped around the stages of a step (planning + collation, the
decoder's forward, the LM head's chunked forward and backward, the whole backward, clipping, the
optimizer) and ``torch.profiler`` recording the ops, from which the attention kernels and the
matmuls outside the head are read. Seconds per step; the stages nest (``backward`` includes
``head backward``), so the table also prints the derived ``decoder backward``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from benchmarks import common as bench
    from benchmarks import throughput as tp
except ModuleNotFoundError:  # run as a script
    import common as bench
    import throughput as tp


#: Stage timers (seconds, summed over the timed steps) and whether they count yet.
CLOCK: dict[str, float] = collections.defaultdict(float)
LIVE = [False]


def _wrap(owner: Any, name: str, label: str, clock: dict[str, float], live: list[bool]) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if live[0]:
                clock[label] += time.perf_counter() - t0

    setattr(owner, name, timed)


def _instrument(clock: dict[str, float], live: list[bool]) -> None:
    import accelerate
    import torch
    import transformers.models.llama.modeling_llama as llama

    import grimoire.batching.loader as loader
    import grimoire.forward.head.function as head
    import grimoire.training.step as step
    import grimoire.training.trainer as trainer

    for owner, name, label in (
        (trainer.GrimoireTrainer, "_optimizer_step", "step"),
        (loader.StepLoader, "step", "plan + collate"),
        (llama.LlamaModel, "forward", "decoder forward"),
        (head._HeadLogps, "forward", "head forward"),
        (head._HeadLogps, "backward", "head backward"),
        (accelerate.Accelerator, "backward", "backward"),
        (step, "clip_gradients", "clip"),
        (torch.optim.AdamW, "step", "optimizer"),
    ):
        _wrap(owner, name, label, clock, live)


def profile(impl: str, args: argparse.Namespace, model: Path) -> dict[str, float]:
    """Seconds per timed step of each stage for one layout."""
    import torch
    from torch.profiler import ProfilerActivity

    clock, live = CLOCK, LIVE
    clock.clear()
    live[0] = False
    steps = {"n": 0}

    class Arm:  # start the clocks after the warm-up steps
        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps["n"] += 1
            live[0] = steps["n"] >= args.warmup
            if steps["n"] == args.warmup:
                prof.start()

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    spec = {
        "impl": impl,
        "precision": args.precision,
        "model": str(model),
        "out": tempfile.mkdtemp(prefix="profile-"),
        "batch": args.batch,
        "max_len": args.max_len,
        "max_tokens": args.max_tokens,
        "device": args.device,
    }
    rows = tp.long_tailed_rows(args.steps * args.batch, tp.MODEL["vocab_size"], args.max_len)
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    if args.cprofile:  # Python-level hot spots of the whole run (host overhead on a GPU)
        import cProfile
        import pstats

        py = cProfile.Profile()
        py.runcall(tp._grimoire_worker, spec, rows, Arm())
        print(f"# {impl}: cProfile, top {args.cprofile} by own time")
        pstats.Stats(py).sort_stats("tottime").print_stats(args.cprofile)
    else:
        tp._grimoire_worker(spec, rows, Arm())
    prof.stop()
    n = args.steps - args.warmup
    # Steps after the last one we count are not timed (live turns on at the warm-up's end).
    out = {k: v / n for k, v in clock.items()}
    ops = {e.key: e for e in prof.key_averages()}

    def self_time(*names: str) -> float:
        return sum(ops[k].self_cpu_time_total for k in names if k in ops) / 1e6 / n

    attention = [k for k in ops if "scaled_dot_product" in k and "backward" not in k.lower()]
    attention_bwd = [k for k in ops if "scaled_dot_product" in k and "backward" in k.lower()]
    out["attention forward (sdpa)"] = self_time(*attention)
    out["attention backward (sdpa)"] = self_time(*attention_bwd)
    out["all matmuls (aten::mm)"] = self_time("aten::mm", "aten::addmm", "aten::bmm")
    out["decoder backward"] = out.get("backward", 0.0) - out.get("head backward", 0.0)
    top = sorted(ops.values(), key=lambda e: e.self_cpu_time_total, reverse=True)
    out["_top"] = [(e.key, e.self_cpu_time_total / 1e6 / n, e.count // n) for e in top]
    if args.device == "cuda":
        gpu = sorted(ops.values(), key=lambda e: e.self_device_time_total, reverse=True)
        out["_top_gpu"] = [(e.key, e.self_device_time_total / 1e6 / n, e.count // n) for e in gpu]
    return out


ORDER = (
    "step",
    "plan + collate",
    "decoder forward",
    "head forward",
    "backward",
    "decoder backward",
    "head backward",
    "attention forward (sdpa)",
    "attention backward (sdpa)",
    "all matmuls (aten::mm)",
    "clip",
    "optimizer",
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--precision", default="no", choices=["no", "bf16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=0, help="also list the N ops with most self time")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cprofile", type=int, default=0, help="print the N hottest Python functions")
    p.add_argument(
        "--cudnn",
        action="store_true",
        help="let grimoire's sdpa calls on CUDA use cuDNN attention (off by default: no per-shape "
        "plans); run with and without to compare",
    )
    args = p.parse_args(argv)
    import torch

    from grimoire.model.packed_attention import allow_cudnn_attention

    allow_cudnn_attention(args.cudnn)
    torch.set_num_threads(args.threads)
    print(bench.machine_line(f", torch threads {args.threads}", cpu_capability=True))
    _instrument(CLOCK, LIVE)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = tp.save_model(
            Path(tmp) / "model", tp.GPU_MODEL if args.device == "cuda" else tp.MODEL
        )
        for impl in ("ours padded", "ours packed"):
            results[impl] = profile(impl, args, model)
    cudnn = "allowed" if args.cudnn else "excluded"
    print(
        f"# s/step over {args.steps - args.warmup} steps, precision {args.precision}, "
        f"cuDNN attention {cudnn} (grimoire's sdpa calls on CUDA)"
    )
    print(f"{'stage':<28} {'padded':>8} {'packed':>8}")
    for key in ORDER:
        a, b = (results[i].get(key, 0.0) for i in ("ours padded", "ours packed"))
        print(f"{key:<28} {a:>8.3f} {b:>8.3f}")
    for impl in ("ours padded", "ours packed") if args.top else ():
        print(f"\n# {impl}: top {args.top} ops by self time (s/step, calls/step)")
        for name, seconds, calls in results[impl]["_top"][: args.top]:
            print(f"{name:<44} {seconds:>8.3f} {calls:>6}")
        if "_top_gpu" in results[impl]:
            print(f"# {impl}: top {args.top} ops by GPU time (s/step, calls/step)")
            for name, seconds, calls in results[impl]["_top_gpu"][: args.top]:
                print(f"{name:<44} {seconds:>8.3f} {calls:>6}")


if __name__ == "__main__":
    main()
