"""Continual learning on a tiny model: task A, then task B by full fine-tuning or by OSFT.

Task A: reverse a string of the letters a-l (``reverse abc=`` -> ``cba``).
Task B: name the first letter of a string of the letters m-x (``first mno=`` -> ``m``).
With ``--tasks known-letters`` task A also copies strings of m-x (``copy mno=`` -> ``mno``), so
task B's tokens are known before it starts, and task A's accuracy is the mean of both tests.
With ``--tasks shared-letters`` all tasks use a-x and only the instruction word differs.

Forgetting and learning trade off through the learning rate, so one run per method says little:
a low rate forgets nothing and learns nothing. This script sweeps the task-B learning rate for
full fine-tuning and for OSFT, then compares the methods *at matched task-B accuracy*: for each
OSFT run it interpolates, along the full fine-tuning sweep, the task-A accuracy that full
fine-tuning keeps when it reaches the same task-B accuracy. All runs share the same task-A model
and are measured in the same process, on 200 held-out prompts per task (greedy exact match, plus
task A's teacher-forced answer NLL).

    python benchmarks/osft_continual.py                    # defaults below, ~10 min on 2 CPU cores
    python benchmarks/osft_continual.py --seeds 0 1        # repeat with another init/data order
    python benchmarks/osft_continual.py --tasks known-letters --full-lrs 1e-5 3e-5 1e-4 3e-4 \
        --osft 0.5:1e-4 0.5:3e-4 0.25:3e-4 0.25:1e-3 --non-targets frozen
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

A_TO_L = "abcdefghijkl"
B_LETTERS = "mnopqrstuvwx"
ALL_LETTERS = A_TO_L + B_LETTERS


def accuracy(model, tokenizer, rows) -> float:
    from grimoire.rollout.engines.generation import greedy_generate_texts

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


def train(model_dir: str, rows, out: str, steps: int, lr: float, seed: int, **extra) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.data import tokenize_sft
    from grimoire.losses import SFTLoss

    tok = AutoTokenizer.from_pretrained(model_dir)
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
        seed=seed,
        **extra,
    )
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=tok,
        config=cfg,
        loss_fn=SFTLoss(),
        train_dataset=[tokenize_sft(r, tok, max_length=64) for r in rows],
    )
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return os.path.join(out, "final")


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The best y reachable at x or beyond: for each x, the largest y of any point with x' >= x.

    With (task-B accuracy, task-A accuracy) points this is the most task A a method keeps while
    reaching at least that task-B accuracy, so a badly chosen learning rate in the sweep cannot
    make the baseline look worse than it is.
    """
    best: list[tuple[float, float]] = []
    top = float("-inf")
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > top:
            top = y
            best.append((x, y))
    return sorted(best)


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x on the piecewise-linear frontier of ``points``.

    Below the frontier's smallest x this is its largest y (a run that reached at least x); above
    its largest x it is None (no run got there, and we do not extrapolate).
    """
    curve = frontier(points)
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


# design -> (reverse letters, copy letters or None, task-B letters, default task-A steps)
DESIGNS = {
    "unseen-letters": (A_TO_L, None, B_LETTERS, 600),
    "known-letters": (A_TO_L, B_LETTERS, B_LETTERS, 800),
    "shared-letters": (ALL_LETTERS, ALL_LETTERS, ALL_LETTERS, 1500),
}


def task_rows(tasks: str, seed: int) -> tuple[list[dict], dict[str, list[dict]], list, list]:
    """(task-A train rows, task-A test sets by name, task-B train rows, task-B test rows).

    ``unseen-letters``: task A reverses words of a-l; task B's letters m-x are new to the model,
    so their (tied) embeddings are still at their random init.
    ``known-letters``: task A also copies words of m-x, so task B starts from known tokens, as a
    new task on a pretrained model does; task A's accuracy is the mean over both of its tests.
    ``shared-letters``: every task uses all of a-x and only the instruction word tells them
    apart, so task A (reverse and copy) and task B (first letter) compete for the same inputs.
    """
    from grimoire.model.tiny import copy_rows, first_letter_rows, reverse_rows

    rev, cop, b_letters, _ = DESIGNS[tasks]
    a_train = reverse_rows(2000, 100 * seed, letters=rev)
    a_tests = {f"reverse {rev[0]}-{rev[-1]}": reverse_rows(200, 100 * seed + 1, letters=rev)}
    if cop is not None:
        a_train = a_train[:1500] + copy_rows(1500, 100 * seed, letters=cop)
        random.Random(seed).shuffle(a_train)
        a_tests[f"copy {cop[0]}-{cop[-1]}"] = copy_rows(200, 100 * seed + 1, letters=cop)
    b_train = first_letter_rows(2000, 100 * seed, letters=b_letters)
    b_test = first_letter_rows(200, 100 * seed + 1, letters=b_letters)
    return a_train, a_tests, b_train, b_test


def run_seed(args, seed: int, tmp: str) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire.model.tiny import save_tiny

    a_train, a_tests, b_train, b_test = task_rows(args.tasks, seed)
    base = str(
        save_tiny(
            os.path.join(tmp, f"base{seed}"),
            seed=seed,
            hidden_size=args.hidden,
            num_layers=args.layers,
        )
    )
    model_a = train(base, a_train, os.path.join(tmp, f"a{seed}"), args.steps_a, args.lr_a, seed)
    tok = AutoTokenizer.from_pretrained(model_a)

    def measure(name: str, path: str, seconds: float) -> dict:
        m = AutoModelForCausalLM.from_pretrained(path)
        a_accs = {test: accuracy(m, tok, rows) for test, rows in a_tests.items()}
        row = {
            "seed": seed,
            "run": name,
            "a_acc": sum(a_accs.values()) / len(a_accs),
            "a_accs": a_accs,
            "a_nll": sum(answer_nll(m, tok, rows) for rows in a_tests.values()) / len(a_tests),
            "b_acc": accuracy(m, tok, b_test),
            "seconds": seconds,
        }
        parts = (
            ""
            if len(a_accs) == 1
            else "  (" + ", ".join(f"{k} {v:.3f}" for k, v in a_accs.items()) + ")"
        )
        print(
            f"{seed:>4}  {name:<34}{row['a_acc']:>7.3f}{row['a_nll']:>8.3f}{row['b_acc']:>7.3f}"
            f"{seconds:>8.0f}{parts}",
            flush=True,
        )
        return row

    print(f"{'seed':>4}  {'run':<34}{'A acc':>7}{'A NLL':>8}{'B acc':>7}{'seconds':>8}")
    rows = [measure("after task A", model_a, 0.0)]
    runs = [(f"full FT lr={lr:g}", lr, {}) for lr in args.full_lrs]
    for spec in args.osft:
        ratio, lr = (float(x) for x in spec.split(":"))
        for train_rest in args.non_targets:
            label = "train" if train_rest else "frozen"
            extra = {
                "osft": True,
                "osft_unfreeze_rank_ratio": ratio,
                "osft_train_non_targets": train_rest,
            }
            runs.append((f"OSFT R={ratio:g} lr={lr:g} rest {label}", lr, extra))
    for name, lr, extra in runs:
        t0 = time.time()
        out = os.path.join(tmp, f"b{seed}_{len(rows)}")
        path = train(model_a, b_train, out, args.steps_b, lr, seed, **extra)
        rows.append(measure(name, path, time.time() - t0))
    return rows


def compare(rows: list[dict]) -> None:
    """Each OSFT run against full fine-tuning interpolated to the same task-B accuracy."""
    print(
        "\nAt matched task-B accuracy (full FT: the best task-A accuracy of its learning-rate sweep"
    )
    print("at that task-B accuracy or higher, interpolated):")
    print(f"{'seed':>4}  {'OSFT run':<34}{'B acc':>7}{'A acc OSFT':>12}{'A acc full':>12}")
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        full = [(r["b_acc"], r["a_acc"]) for r in mine if r["run"].startswith("full")]
        for r in mine:
            if not r["run"].startswith("OSFT"):
                continue
            ref = interpolate(full, r["b_acc"])
            ref_text = f"{ref:>12.3f}" if ref is not None else f"{'none':>12}"
            print(f"{seed:>4}  {r['run']:<34}{r['b_acc']:>7.3f}{r['a_acc']:>12.3f}{ref_text}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--tasks",
        choices=list(DESIGNS),
        default="unseen-letters",
        help="how task B's inputs relate to task A's (see task_rows)",
    )
    ap.add_argument(
        "--steps-a", type=int, help="default: 600, 800 (known-letters), 1500 (shared-letters)"
    )
    ap.add_argument("--steps-b", type=int, default=200)
    ap.add_argument("--lr-a", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument(
        "--full-lrs", type=float, nargs="+", default=[3e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3]
    )
    ap.add_argument(
        "--osft",
        nargs="+",
        default=["0.5:5e-4", "0.5:1e-3", "0.5:2e-3", "0.25:1e-3", "0.25:2e-3"],
        help="RATIO:LR pairs",
    )
    ap.add_argument(
        "--non-targets",
        choices=["train", "frozen", "both"],
        default="both",
        help="osft_train_non_targets for the OSFT runs (embeddings, norms, LM head)",
    )
    ap.add_argument("--json-out", help="also write every measured row to this JSON file")
    ap.add_argument(
        "--from-json",
        nargs="+",
        metavar="FILE",
        help="train nothing: print the matched comparison of rows saved by --json-out (several "
        "files are pooled, e.g. a denser full fine-tuning sweep run later)",
    )
    args = ap.parse_args()
    if args.from_json:
        pooled: dict[tuple, dict] = {}
        for path in args.from_json:
            with open(path) as f:
                for row in json.load(f):  # a run repeated across files is kept once
                    pooled.setdefault((row["seed"], row["run"]), row)
        compare(list(pooled.values()))
        return
    if args.steps_a is None:
        args.steps_a = DESIGNS[args.tasks][3]
    args.non_targets = {"train": [True], "frozen": [False], "both": [True, False]}[args.non_targets]
    print(
        f"{args.tasks}: tiny Llama {args.layers}x{args.hidden}; task A {args.steps_a} steps at lr {args.lr_a:g}, task B "
        f"{args.steps_b} steps (batch 32, cosine, bf16 autocast)"
    )
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            rows += run_seed(args, seed, tmp)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    compare(rows)


if __name__ == "__main__":
    main()
