"""Preference training throughput: DPO with a live reference vs ``precompute_ref_log_probs``, and
the published peer ``grimoire-rl`` 2.1.3; ORPO at a 128k vocabulary (peak memory, tok/s).

Every measurement runs in a fresh subprocess (peak RSS is per process). Both packages are named
``grimoire``, so the peer runs under ``/work/venvs/peers/bin/python`` without this repository on
``PYTHONPATH``, through its README's Python API (``GrimoireTrainer``, ``TrainingConfig``,
``DPOLoss(ref_model=...)``, ``ORPOLoss``). Both sides get the same Llama (built from the same
config with seed 0), the same token rows (seeded random ids in the shared column format) and the
same settings: fp32, constant lr, no dropout, no checkpointing, one epoch of ``steps x batch``
rows. tok/s counts the real (non-pad) chosen + rejected tokens trained over ``train()``'s wall
time; the precompute column's reference pass happens before ``train()`` and is shown apart.

    python benchmarks/preference_throughput.py            # full tables
    python benchmarks/preference_throughput.py --tiny     # seconds: table shape only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

PEER_PYTHON = Path("/work/venvs/peers/bin/python")
PEER_LOG = Path("/work/venvs/peers.log")
SIZES = {
    "full": dict(
        hidden=256, layers=4, rows=32, batch=8, prompt=64, completion=96, orpo_vocab=128_000
    ),
    "tiny": dict(hidden=32, layers=1, rows=4, batch=2, prompt=6, completion=8, orpo_vocab=4096),
}


def make_rows(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    """Preference rows in the shared column format: prompt tokens masked (-100) in the labels;
    completion lengths vary between half and all of ``completion``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        p = [rng.randrange(2, vocab) for _ in range(prompt)]
        row = {}
        for side in ("chosen", "rejected"):
            c = [rng.randrange(2, vocab) for _ in range(rng.randint(completion // 2, completion))]
            row[f"{side}_input_ids"] = p + c
            row[f"{side}_attention_mask"] = [1] * (len(p) + len(c))
            row[f"{side}_labels"] = [-100] * len(p) + c
        rows.append(row)
    return rows


def build_llama(vocab: int, hidden: int, layers: int, positions: int) -> Any:
    """The same model on both sides: transformers' Llama from one config, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


class _Tok:
    """What the trainers read of a tokenizer (rows are tokens)."""

    pad_token, eos_token = "<pad>", "</s>"
    pad_token_id = 0
    eos_token_id = 1

    def __len__(self) -> int:
        return 2

    def save_pretrained(self, *_: Any, **__: Any) -> None:
        pass


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process; prints its JSON."""
    import torch
    from datasets import Dataset

    torch.manual_seed(0)
    size = SIZES[args.size]
    vocab = args.vocab
    rows = make_rows(size["rows"], vocab, size["prompt"], size["completion"])
    tokens = sum(sum(r[f"{s}_attention_mask"]) for r in rows for s in ("chosen", "rejected"))
    positions = size["prompt"] + size["completion"] + 8
    model = build_llama(vocab, size["hidden"], size["layers"], positions)
    common = dict(
        output_dir=args.out,
        num_epochs=1,
        batch_size=size["batch"],
        learning_rate=1e-5,
        warmup_ratio=0.0,
        lr_scheduler="constant",
        mixed_precision="no",
        disable_dropout=True,
        gradient_checkpointing=False,
        save_on_epoch_end=False,
        logging_steps=1000,
    )
    if args.impl == "peer":
        from grimoire import GrimoireTrainer, TrainingConfig
        from grimoire.losses import DPOLoss, ORPOLoss

        config = TrainingConfig(**common)
    else:
        from grimoire import GrimoireTrainer, TrainingConfig
        from grimoire.losses import DPOLoss, ORPOLoss

        config = TrainingConfig(
            **common, progress_bar=False, precompute_ref_log_probs=args.impl == "precompute"
        )
    if args.method == "dpo":
        ref = build_llama(vocab, size["hidden"], size["layers"], positions).eval()
        loss = DPOLoss(ref_model=ref, beta=0.1)
    else:
        loss = ORPOLoss(beta=0.1)
    bench.reset_peak()
    start = time.perf_counter()
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=_Tok(),
        config=config,
        loss_fn=loss,
        train_dataset=Dataset.from_list(rows),
    )
    built = time.perf_counter()
    trainer.train()
    done = time.perf_counter()
    return {
        "impl": args.impl,
        "tokens": tokens,
        "init_s": built - start,
        "train_s": done - built,
        "tok_s": tokens / (done - built),
        "peak_mb": bench.peak_mb(),
    }


def peer_available() -> str | None:
    """None when the peer venv is usable, else why not."""
    if not PEER_PYTHON.exists():
        return f"{PEER_PYTHON} missing"
    if not PEER_LOG.exists() or "done" not in PEER_LOG.read_text().split():
        return f"{PEER_LOG} does not say done"
    return None


def measure(impl: str, method: str, vocab: int, size: str, out: str) -> dict[str, Any]:
    cmd = [__file__, "--worker", "--impl", impl, "--method", method, "--vocab", str(vocab)]
    cmd += ["--size", size, "--out", out]
    if impl == "peer":
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = bench.run_or_exit([str(PEER_PYTHON), *cmd], f"peer {method}", env)
    else:
        result = bench.run_or_exit([sys.executable, *cmd], f"{impl} {method}", bench.child_env())
    return bench.last_json(result.stdout)


def tables(size: str, out: str, peer: bool = True) -> list[str]:
    """Both tables as markdown lines."""
    s = SIZES[size]
    why_not = peer_available() if peer else "not asked (--no-peer)"
    impls = ["live", "precompute"] + ([] if why_not else ["peer"])
    lines = [
        bench.machine_line(),
        f"# DPO, vocab 32000, hidden {s['hidden']}, {s['layers']} layers, {s['rows']} pairs, "
        f"batch {s['batch']}, fp32",
        "| impl | tok/s | vs live | train s | init s (incl. precompute) | peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    dpo = {i: measure(i, "dpo", 32_000, size, f"{out}/dpo-{i}") for i in impls}
    for impl, r in dpo.items():
        ratio = r["tok_s"] / dpo["live"]["tok_s"]
        lines.append(
            f"| {impl} | {r['tok_s']:.0f} | {ratio:.2f}x | {r['train_s']:.2f} | "
            f"{r['init_s']:.2f} | {r['peak_mb']:.0f} |"
        )
    if why_not:
        lines.append(f"(peer grimoire-rl 2.1.3 skipped: {why_not})")
    vocab = s["orpo_vocab"]
    lines += [
        f"# ORPO, vocab {vocab}, same model and rows otherwise",
        "| impl | tok/s | vs ours | peak RSS MiB | vs ours |",
        "|---|---|---|---|---|",
    ]
    orpo = {i: measure(i, "orpo", vocab, size, f"{out}/orpo-{i}") for i in ["live"] + impls[2:]}
    for impl, r in orpo.items():
        name = "ours" if impl == "live" else impl
        lines.append(
            f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / orpo['live']['tok_s']:.2f}x | "
            f"{r['peak_mb']:.0f} | {r['peak_mb'] / orpo['live']['peak_mb']:.2f}x |"
        )
    if why_not:
        lines.append(f"(peer grimoire-rl 2.1.3 skipped: {why_not})")
    return lines


def main(argv: list[str] | None = None) -> list[str] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--no-peer", action="store_true", help="skip the grimoire-rl column")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="live", choices=["live", "precompute", "peer"])
    parser.add_argument("--method", default="dpo", choices=["dpo", "orpo"])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--size", default="full", choices=list(SIZES))
    parser.add_argument("--out", default="/tmp/preference-throughput")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    lines = tables("tiny" if args.tiny else args.size, args.out, not args.no_peer)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
