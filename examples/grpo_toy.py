"""Online RL on a toy verifiable task, CPU-only in 1-2 minutes: SFT warm-up, then GRPO.

The task is grimoire's reverse task (``reverse abc=`` -> ``cba``); the answer is checked exactly,
and the training reward gives partial credit (fraction of characters in the right place), which
a small policy can climb in few steps. A tiny Llama is first fine-tuned with ``SFTLoss`` for a
short warm-up (so it samples sensible completions), then trained online with ``GRPOMethod``
(or ``--method rloo | online_dpo | raft``). Held-out mean rewards are printed before and after:
the expected reward of sampled completions (what online RL maximises) and greedy accuracy.

    python examples/grpo_toy.py
    python examples/grpo_toy.py --method rloo --rl-steps 30
    python examples/grpo_toy.py --engine vllm     # sample with a colocated vLLM engine

(``--engine vllm`` needs ``pip install 'grimoire[vllm]'``; the tiny model's 32-wide attention
heads are the smallest vLLM's CPU build runs.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer, TrainingConfig
from grimoire.data import tokenize_sft
from grimoire.losses import SFTLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.raft import RAFTMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.model.tiny import reverse_rows, save_tiny
from grimoire.rollout.rewards.scoring import (
    char_match_reward,
    evaluate_rewards,
    exact_match_reward,
)
from grimoire.rows.prompts import tokenize_grpo

MAX_NEW_TOKENS = 8  # answers are <= 6 characters + EOS


def quiet(output_dir: str, **overrides) -> TrainingConfig:
    values = dict(
        output_dir=output_dir,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        weight_decay=0.0,
        logging_steps=10,
        seed=0,
    )
    values.update(overrides)
    return TrainingConfig(**values)


def warm_up(model_dir: Path, out_dir: Path, steps: int) -> Path:
    """SFT on the reverse task: a partly competent policy to start RL from."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(2000, seed=0)]
    config = quiet(
        str(out_dir / "sft"),
        max_steps=steps,
        batch_size=32,
        learning_rate=3e-3,
        warmup_steps=10,
        lr_scheduler="cosine",
    )
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=SFTLoss(), train_dataset=rows
    )
    trainer.train()
    return trainer.save_model(out_dir / "warm")


def build_method(name: str, num_generations: int, engine: str = "hf"):
    common = dict(reward_funcs=[char_match_reward], max_new_tokens=MAX_NEW_TOKENS, engine=engine)
    if name == "grpo":
        return GRPOMethod(num_generations=num_generations, **common)
    if name == "rloo":
        return RLOOMethod(num_generations=num_generations, beta=0.0, **common)
    if name == "online_dpo":
        return OnlineDPOMethod(num_generations=num_generations, **common)
    if name == "raft":
        return RAFTMethod(num_generations=num_generations, **common)
    raise ValueError(f"unknown method {name!r}")


def heldout(model, tok, rows) -> dict[str, float]:
    sampled = evaluate_rewards(
        model,
        tok,
        rows,
        [char_match_reward],
        greedy=False,
        num_samples=8,
        max_new_tokens=MAX_NEW_TOKENS,
        seed=0,
    )
    greedy = evaluate_rewards(
        model, tok, rows, [exact_match_reward], greedy=True, max_new_tokens=MAX_NEW_TOKENS
    )
    return {"sampled_reward": sampled["reward"], "greedy_exact": greedy["reward"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="grpo", choices=["grpo", "rloo", "online_dpo", "raft"])
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=120)
    parser.add_argument("--num-generations", type=int, default=16)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="rollout sampler")
    parser.add_argument("--heldout", type=int, default=128, help="held-out prompts scored")
    parser.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo_toy_"))

    t0 = time.time()
    tiny = save_tiny(out / "tiny", hidden_size=128)
    warm = warm_up(tiny, out, args.sft_steps)
    print(f"SFT warm-up: {args.sft_steps} steps in {time.time() - t0:.0f}s -> {warm}")

    tok = AutoTokenizer.from_pretrained(warm)
    model = AutoModelForCausalLM.from_pretrained(warm)
    held = reverse_rows(args.heldout, seed=123)  # disjoint seed from the training prompts
    before = heldout(model, tok, held)

    prompts = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(1024, seed=7)]
    config = quiet(
        str(out / args.method),
        max_steps=args.rl_steps,
        batch_size=args.prompts_per_step,
        learning_rate=args.lr,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        disable_dropout=True,
    )
    t1 = time.time()
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=build_method(args.method, args.num_generations, args.engine),
        train_dataset=prompts,
    )
    trainer.train()
    trainer.close()  # shuts a vLLM engine down
    after = heldout(model, tok, held)
    print(f"{args.method} ({args.engine}): {args.rl_steps} steps in {time.time() - t1:.0f}s")
    print(f"held-out ({args.heldout} prompts)".ljust(30) + "before   after")
    for key in before:
        print(f"  {key:<26} {before[key]:7.3f} {after[key]:7.3f}")
    print(f"metrics log: {config.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
