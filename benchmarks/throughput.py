"""SFT training throughput against peers: trained tokens per second and model FLOPs utilisation.

Run: ``python benchmarks/throughput.py`` (about 10 minutes on 2 cores; ``--tiny`` for a seconds-
long smoke run). Every column trains the same model (a 4-layer x 256 Llama, 32k vocabulary,
random init, saved once and loaded by each run) on the same long-tailed SFT rows (lengths <= 512,
the first quarter of each row a masked prompt), batch 8, one constant learning rate, default
activation checkpointing (ours: ``auto``), each in a fresh subprocess:

- ``ours packed``: this repository, ``padding_free=True`` + ``max_tokens_per_device``;
- ``ours padded``: this repository, padded micro-batches;
- ``grimoire-rl``: grimoire-rl 2.1.3 through its README Python API, run with the interpreter
  of the venv at ``--peer-python`` (both packages are named ``grimoire``); skipped with a note
  where that venv is missing;
- ``trl``: TRL's ``SFTTrainer`` (completion-only loss from a ``completion_mask``);
- like-for-like columns for activation checkpointing, which our ``auto`` turns off on a CPU with
  room to spare while grimoire-rl and TRL keep theirs on by default: ``ours packed+ckpt``
  (ours packed, ``gradient_checkpointing=True``) and ``grimoire-rl no-ckpt`` (the peer with
  ``gradient_checkpointing=False``).

Rows per precision (``--precisions``): ``no`` (fp32) and ``bf16`` (autocast). The first
``--warmup`` steps are not timed. Trained tokens are label tokens (the response tokens a loss
is taken on); the timed steps' count is the run's label tokens times their share of the steps
(the rows are shuffled, so this is an estimate for a short run). ``--repeats N`` runs every
column N times, interleaved, and reports the median (the peers' own figure moves by up to 20%
between runs on this shared machine). MFU is model FLOPs
(``6 x parameters`` per real token without the embedding lookup, plus causal attention) per
second over a peak measured here at start: the best of fp32 (or bf16) GEMMs of the model's
shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

PEER_PYTHON = "/work/venvs/peers/bin/python"
IMPLS = (
    "ours packed",
    "ours packed+ckpt",
    "ours padded",
    "grimoire-rl",
    "grimoire-rl no-ckpt",
    "trl",
)
PEER = "grimoire-rl"  # the column the ``x peer`` ratios are taken against
MODEL = dict(vocab_size=32000, hidden_size=256, num_layers=4, max_position_embeddings=512)
TINY_MODEL = dict(vocab_size=512, hidden_size=32, num_layers=1, max_position_embeddings=64)
#: ``--device cuda``: a model big enough that a GPU step is not all launch overhead.
GPU_MODEL = dict(vocab_size=32000, hidden_size=1024, num_layers=8, max_position_embeddings=2048)
#: ``--model 1b``: 1.04B parameters (24 x 2048, GQA 16/8 heads of 128, MLP 4096, untied 32k
#: vocabulary), for MFU at a realistic size (issue #25: >= 1B at 16k tokens per step).
MODEL_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    num_layers=24,
    max_position_embeddings=2048,
    num_attention_heads=16,
    num_key_value_heads=8,
)


# --------------------------------------------------------------------------- data and model


def long_tailed_rows(
    n: int, vocab: int, max_len: int, seed: int = 0, *, low: int = 16, scale: float = 100.0
) -> list[dict[str, list[int]]]:
    """SFT rows with Pareto-distributed lengths (median ~75 at the defaults, tail clipped at
    ``max_len``): ``input_ids``, ``attention_mask``, ``labels`` (-100 on the first quarter, the
    prompt) and ``completion_mask`` (TRL's name for the same split). numpy only, so the peer's
    interpreter builds the same rows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.minimum(max_len, low + (rng.pareto(1.5, n) * scale).astype(np.int64))
    rows = []
    for length in lengths.tolist():
        ids = rng.integers(3, vocab, length).tolist()
        prompt = max(1, length // 4)
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": [1] * length,
                "labels": [-100] * prompt + ids[prompt:],
                "completion_mask": [0] * prompt + [1] * (length - prompt),
            }
        )
    return rows


def model_flops(rows: list[dict[str, Any]], params: int, layers: int, hidden: int) -> float:
    """Training FLOPs the model needs for ``rows`` (forward + backward, no recomputation):
    ``6 x params`` per real token plus causal attention scores and values
    (``6 x layers x hidden x len^2``: 4 x L x d x n^2 forward, halved by the mask, x3)."""
    tokens = sum(len(r["input_ids"]) for r in rows)
    attention = sum(6 * layers * hidden * len(r["input_ids"]) ** 2 for r in rows)
    return 6.0 * params * tokens + attention


def measured_peak(
    hidden: int, vocab: int, intermediate: int, dtype: str, tokens: int, device: str = "cpu"
) -> float:
    """The best GFLOP/s of the model's GEMMs (head, MLP, attention projection, forward and the
    backward's transposed forms) at ``tokens`` rows, best of 3 after one warm-up call."""
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = 0.0
    for out in (vocab, intermediate, hidden):
        x = torch.randn(tokens, hidden, generator=g).to(device, dt)
        w = torch.randn(out, hidden, generator=g).to(device, dt)
        dy = torch.randn(tokens, out, generator=g).to(device, dt)
        for fn in (
            lambda x=x, w=w: x @ w.t(),
            lambda w=w, dy=dy: dy @ w,
            lambda x=x, dy=dy: dy.t() @ x,
        ):
            fn()
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best = max(best, 2.0 * tokens * hidden * out / (time.perf_counter() - t0) / 1e9)
    return best


def save_model(path: Path, spec: dict[str, int]) -> Path:
    from grimoire.model.tiny import save_tiny

    return save_tiny(path, arch="llama", seed=0, tie_word_embeddings=False, **spec)


# --------------------------------------------------------------------------- workers


def _grimoire_worker(
    spec: dict[str, Any], rows: list[dict[str, Any]], clock: bench.StepClock
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses import SFTLoss

    keep = ("input_ids", "attention_mask", "labels")
    rows = [{k: r[k] for k in keep} for r in rows]
    if spec.get("cudnn") and not spec["impl"].startswith("grimoire-rl"):
        from grimoire.model.packed_attention import allow_cudnn_attention

        allow_cudnn_attention(True)
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    common = dict(
        output_dir=spec["out"],
        num_epochs=1,
        batch_size=spec["batch"],
        learning_rate=1e-5,
        warmup_ratio=0.0,
        lr_scheduler="constant",
        mixed_precision=spec["precision"],
        save_on_epoch_end=False,
        max_length=spec["max_len"],
        logging_steps=10**6,
    )
    if spec["impl"] == "grimoire-rl":
        config = TrainingConfig(**common)
    elif spec["impl"] == "grimoire-rl no-ckpt":
        config = TrainingConfig(**common, gradient_checkpointing=False)
    else:
        extra: dict[str, Any] = dict(progress_bar=False)
        if spec["impl"].startswith("ours packed"):
            extra.update(padding_free=True, max_tokens_per_device=spec["max_tokens"])
            if spec["impl"].endswith("+ckpt"):
                extra.update(gradient_checkpointing=True)
        else:  # the padded baseline (the default, auto, would pack these long-tailed rows)
            extra.update(padding_free=False, pad_to_multiple_of=spec.get("pad_multiple"))
        config = TrainingConfig(**common, **extra)
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tokenizer,
        config=config,
        loss_fn=SFTLoss(),
        train_dataset=rows,
        callbacks=[clock],
    )
    trainer.train()


def _trl_worker(spec: dict[str, Any], rows: list[dict[str, Any]], clock: bench.StepClock) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.on_step_end()

    data = Dataset.from_list([{k: r[k] for k in ("input_ids", "completion_mask")} for r in rows])
    config = SFTConfig(
        output_dir=spec["out"],
        num_train_epochs=1,
        per_device_train_batch_size=spec["batch"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        bf16=spec["precision"] == "bf16",
        use_cpu=spec.get("device", "cpu") == "cpu",
        max_length=spec["max_len"],
        completion_only_loss=True,
        gradient_checkpointing=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        seed=42,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec["model"]),
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        callbacks=[Clock()],
    )
    trainer.train()


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One training run; prints ``{"seconds", "steps", "timed_steps"}``."""
    import torch

    torch.set_num_threads(spec["threads"])
    rows = long_tailed_rows(spec["rows"], spec["vocab"], spec["max_len"], spec["seed"])
    clock = bench.StepClock(cuda=spec.get("device") == "cuda")
    if spec["impl"] == "trl":
        _trl_worker(spec, rows, clock)
    else:
        _grimoire_worker(spec, rows, clock)
    steps = len(clock.times)
    warm = min(spec["warmup"], steps - 1)
    return {
        "seconds": clock.times[-1] - clock.times[warm - 1] if warm else None,
        "steps": steps,
        "timed_steps": steps - warm,
    }


# --------------------------------------------------------------------------- driver


def run_impl(impl: str, precision: str, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """One column in a fresh process; ``{"skipped": why}`` for a missing peer."""
    spec = {
        "impl": impl,
        "precision": precision,
        "model": str(model),
        "out": tempfile.mkdtemp(prefix="throughput-"),
        "rows": args.steps * args.batch,
        "batch": args.batch,
        "max_len": args.max_len,
        "max_tokens": args.max_tokens,
        "vocab": args.spec["vocab_size"],
        "seed": args.seed,
        "warmup": args.warmup,
        "threads": args.threads,
        "device": args.device,
        "cudnn": args.cudnn,
        "pad_multiple": args.pad_multiple,
    }
    script = str(Path(__file__).resolve())
    if impl.startswith("grimoire-rl"):
        python = args.peer_python
        if not Path(python).exists():
            return {"skipped": f"no peer venv at {python}"}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer's grimoire
    else:
        python, env = sys.executable, bench.child_env()
    result = bench.run_or_exit([python, script, "--worker", json.dumps(spec)], impl, env)
    return bench.last_json(result.stdout)


def table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of ``{precision, impl, tok_s, ratio, mfu, note}``, printed as they come."""
    import torch

    from grimoire.model.tiny import build_model

    spec = args.spec
    with torch.device("meta"):  # counted, not built: no memory, no init (a 1B model is 4 GB)
        probe = build_model("llama", seed=0, tie_word_embeddings=False, **spec)
    params = (
        sum(p.numel() for p in probe.parameters()) - probe.get_input_embeddings().weight.numel()
    )
    intermediate = probe.config.intermediate_size
    del probe
    torch.set_num_threads(args.threads)
    rows = long_tailed_rows(args.steps * args.batch, spec["vocab_size"], args.max_len, args.seed)
    labels = sum(sum(x != -100 for x in r["labels"]) for r in rows)
    flops = model_flops(rows, params, spec["num_layers"], spec["hidden_size"])
    mean_tokens = sum(len(r["input_ids"]) for r in rows) // len(rows) * args.batch
    print(
        bench.machine_line(
            f", torch threads {args.threads}",
            cpu_capability=True,
            tail=f"steps {args.steps}"
            + (f"; GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        )
    )
    print(
        f"# data: {len(rows)} rows, lengths <= {args.max_len}, mean "
        f"{mean_tokens // args.batch}, {labels} label tokens; batch {args.batch}; packed "
        f"max_tokens_per_device {args.max_tokens}; model {spec}, {params / 1e6:.1f}M non-embedding "
        "parameters"
    )
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "model", spec)
        for precision in args.precisions:
            peak = measured_peak(
                spec["hidden_size"],
                spec["vocab_size"],
                intermediate,
                precision,
                mean_tokens,
                args.device,
            )
            label = "fp32" if precision == "no" else precision
            print(f"\n## {label}  (GEMM peak measured here: {peak:.0f} GFLOP/s)")
            # Interleaved repeats: a slow spell of the machine hits every column alike.
            runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in args.impls}
            for _ in range(args.repeats):
                for impl in args.impls:
                    runs[impl].append(run_impl(impl, precision, args, model))
            print(f"{'impl':<19} {'tok/s':>8} {'x padded':>9} {'x peer':>7} {'MFU':>7}  note")
            for impl in args.impls:
                row: dict[str, Any] = {"precision": label, "impl": impl, "note": ""}
                row.update(ratio=None, ratio_peer=None, tok_s=None, mfu=None)
                timed = [r for r in runs[impl] if r.get("seconds")]
                if not timed:
                    r = runs[impl][0]
                    row["note"] = r.get("skipped", "too few steps to time")
                else:
                    # labels x share: the label tokens of the timed steps (an estimate, above).
                    rates = sorted(
                        labels * r["timed_steps"] / r["steps"] / r["seconds"] for r in timed
                    )
                    row["tok_s"] = rates[len(rates) // 2]  # the median (upper, for an even count)
                    row["tok_s_runs"] = rates
                    row["mfu"] = row["tok_s"] * flops / labels / 1e9 / peak
                    if len(rates) > 1:
                        row["note"] = f"median of {len(rates)}: {min(rates):.0f}-{max(rates):.0f}"
                out.append(row)
            mine = out[-len(args.impls) :]
            # Ratios against our padded path and against grimoire-rl, where each ran.
            base = next((r["tok_s"] for r in mine if r["impl"] == "ours padded"), None)
            peer = next((r["tok_s"] for r in mine if r["impl"] == PEER), None)
            for row in mine:
                if row["tok_s"] is not None:
                    row["ratio"] = row["tok_s"] / base if base else None
                    row["ratio_peer"] = row["tok_s"] / peer if peer else None
                print(_fmt(row))
    return out


def _fmt(row: dict[str, Any]) -> str:
    def num(x: float | None, f: str) -> str:
        return "-" if x is None else format(x, f)

    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    return (
        f"{row['impl']:<19} {num(row['tok_s'], '.0f'):>8} {num(row['ratio'], '.2f'):>9} "
        f"{num(row['ratio_peer'], '.2f'):>7} {mfu:>7}  {row['note']}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (one epoch)")
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2048, help="packed max_tokens_per_device")
    p.add_argument("--precisions", nargs="+", default=["no", "bf16"], choices=["no", "bf16"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--peer-python", default=PEER_PYTHON)
    # One thread by default: on a machine shared with other jobs, torch's OpenMP threads wait on
    # descheduled siblings and a 2-thread step measured 5-20x slower and erratic (see
    # docs/performance.md); pass --threads N on an idle machine.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per column (the median is shown)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tiny model)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: every run trains on the GPU (accelerate places it), a 1024 x 8 model",
    )
    p.add_argument(
        "--model",
        default="auto",
        choices=["auto", "1b"],
        help="auto: 4 x 256 on a CPU, 1024 x 8 with --device cuda; 1b: a 1.04B Llama",
    )
    p.add_argument(
        "--pad-multiple",
        type=int,
        default=None,
        help="ours padded: pad_to_multiple_of (default: the library's, 64 on CUDA, off on a CPU)",
    )
    p.add_argument(
        "--cudnn",
        action="store_true",
        help="let grimoire's sdpa calls on CUDA use cuDNN attention (off by default)",
    )
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.spec = dict(TINY_MODEL if args.tiny else GPU_MODEL if args.device == "cuda" else MODEL)
    if args.model == "1b":
        args.spec = dict(MODEL_1B)
    if args.tiny:
        args.max_len = min(args.max_len, TINY_MODEL["max_position_embeddings"])
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return None
    rows = table(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
