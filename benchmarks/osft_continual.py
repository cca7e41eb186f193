"""Continual learning on the tiny model: task A (reverse a string), then task B (name its first
letter) with full fine-tuning vs OSFT at several unfreeze ratios, all measured in one run.

Reported on held-out prompts: task-A exact match and task-A answer NLL (forgetting shows first in
the NLL; exact match of a 2-layer model is brittle), and task-B exact match.

    python benchmarks/osft_continual.py [--steps-a 600] [--steps-b 200] [--ratios 0.25 0.5 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def accuracy(model, tokenizer, rows) -> float:
    from grimoire.rollout.generation import greedy_generate_texts

    texts = greedy_generate_texts(model, tokenizer, [r["prompt"] for r in rows], 8, 64)
    return sum(t.strip() == r["answer"] for t, r in zip(texts, rows)) / len(rows)


def answer_nll(model, tokenizer, rows) -> float:
    """Token-mean NLL of the reference answers (teacher-forced), via the SFT loss."""
    import torch

    from grimoire.data import SFTCollator, tokenize_sft
    from grimoire.losses import SFTLoss

    batch = SFTCollator(tokenizer.pad_token_id)([tokenize_sft(r, tokenizer) for r in rows])
    with torch.no_grad():
        return float(SFTLoss(fused=False)(model.eval(), batch, training=False)[0])


def train(model_dir: str, rows, out: str, steps: int, lr: float = 3e-3, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.data import tokenize_sft
    from grimoire.losses import SFTLoss

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = [tokenize_sft(r, tok, max_length=64) for r in rows]
    cfg = TrainingConfig(
        output_dir=out,
        max_steps=steps,
        batch_size=32,
        learning_rate=lr,
        lr_scheduler="cosine",
        warmup_steps=30,
        weight_decay=0.0,
        mixed_precision="bf16",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=50,
        seed=0,
        **extra,
    )
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=tok,
        config=cfg,
        loss_fn=SFTLoss(),
        train_dataset=data,
    )
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(x)["loss"] for x in f]
    return os.path.join(out, "final"), tok, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps-a", type=int, default=600)
    ap.add_argument("--steps-b", type=int, default=200)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--lr-b", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from grimoire.tiny import first_letter_rows, reverse_rows, save_tiny

    a_train, a_test = reverse_rows(2000, 0), reverse_rows(200, 1)
    b_train, b_test = first_letter_rows(2000, 0), first_letter_rows(200, 1)

    def report(name: str, path: str, tok, seconds: float, b_loss: float | None = None) -> None:
        m = AutoModelForCausalLM.from_pretrained(path)
        cells = [accuracy(m, tok, a_test), answer_nll(m, tok, a_test), accuracy(m, tok, b_test)]
        last = f"{b_loss:>13.3f}" if b_loss is not None else f"{'-':>13}"
        print(
            f"{name:<22}{cells[0]:>8.3f}{cells[1]:>10.3f}{cells[2]:>8.3f}{last}{seconds:>9.0f}",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as tmp:
        base = str(
            save_tiny(os.path.join(tmp, "base"), hidden_size=args.hidden, num_layers=args.layers)
        )
        t0 = time.time()
        model_a, tok, _ = train(base, a_train, os.path.join(tmp, "a"), args.steps_a)
        print(
            f"task A: reverse, {args.steps_a} steps; task B: first letter, {args.steps_b} "
            f"steps at lr {args.lr_b}; greedy exact match / answer NLL on 200 held-out prompts"
        )
        print(
            f"{'model':<22}{'A acc':>8}{'A NLL':>10}{'B acc':>8}{'B train loss':>13}{'seconds':>9}"
        )
        report("after task A", model_a, tok, time.time() - t0)
        runs = [("B: full fine-tuning", {})] + [
            (f"B: OSFT R={r}", {"osft": True, "osft_unfreeze_rank_ratio": r}) for r in args.ratios
        ]
        for name, extra in runs:
            t0 = time.time()
            out = os.path.join(tmp, name.replace(" ", "_").replace(":", ""))
            path, _, losses = train(model_a, b_train, out, args.steps_b, lr=args.lr_b, **extra)
            report(name, path, tok, time.time() - t0, losses[-1])


if __name__ == "__main__":
    main()
