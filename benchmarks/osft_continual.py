"""Continual learning on the tiny model: task A (reverse), then task B (shift) with full
fine-tuning vs OSFT at several unfreeze ratios. Reports task-A retention and task-B accuracy
(greedy exact match on held-out prompts), all measured in one run.

    python benchmarks/osft_continual.py [--steps-a 600] [--steps-b 300] [--ratios 0.25 0.5 0.75]
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
    losses = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
    return os.path.join(out, "final"), tok, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps-a", type=int, default=600)
    ap.add_argument("--steps-b", type=int, default=300)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--lr-b", type=float, default=3e-3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from grimoire.tiny import reverse_rows, save_tiny, shift_rows

    a_train, a_test = reverse_rows(2000, 0), reverse_rows(200, 1)
    b_train, b_test = shift_rows(2000, 0), shift_rows(200, 1)
    with tempfile.TemporaryDirectory() as tmp:
        base = str(save_tiny(os.path.join(tmp, "base")))
        t0 = time.time()
        model_a, tok, _ = train(base, a_train, os.path.join(tmp, "a"), args.steps_a)
        m = AutoModelForCausalLM.from_pretrained(model_a)
        print(
            f"after task A ({args.steps_a} steps, {time.time() - t0:.0f}s): "
            f"A={accuracy(m, tok, a_test):.3f}  B={accuracy(m, tok, b_test):.3f}"
        )
        runs = [("full fine-tuning", {})] + [
            (f"OSFT R={r}", {"osft": True, "osft_unfreeze_rank_ratio": r}) for r in args.ratios
        ]
        print(f"\n{'task B run':<20}{'A retained':>12}{'B acc':>8}{'B loss':>8}{'seconds':>9}")
        for name, extra in runs:
            t0 = time.time()
            path, _ = train(
                model_a, b_train, os.path.join(tmp, name.replace(" ", "_")), args.steps_b, **extra
            )
            m = AutoModelForCausalLM.from_pretrained(path)
            print(
                f"{name:<20}{accuracy(m, tok, a_test):>12.3f}{accuracy(m, tok, b_test):>8.3f}"
                f"{time.time() - t0:>9.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
