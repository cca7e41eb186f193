"""GRPO on multi-turn tool episodes: does the tiny lookup task's success rate rise?

A tiny Llama gets an SFT warm start on ``lookup_chat_rows`` (``SFT_STEPS``, default 750: it
knows the call format only partly, see ``benchmarks/agentic_warm_start.py``), then GRPO trains
it on episodes through the trainer's rollout stage: ``tools=[lookup]``, the ``tiny`` parser,
``<|end|>`` as the end-of-turn stop token, reward functions ``REWARDS`` (comma-separated,
default ``exact_match``; ``exact_match,char_match`` adds partial credit for copying the tool's
answer). The success rate is the exact-match one, read from ``metrics.jsonl``
(``rewards/exact_match_reward/mean`` per step, sampled episodes at temperature 1): the mean of
the first and of the last ``WINDOW`` steps.

    PYTHONPATH=src python benchmarks/agentic_lookup_rl.py [SFT_STEPS] [RL_STEPS] [ENGINE] [LR] \
        [REWARDS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from grimoire import GrimoireTrainer, TrainingConfig

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_tokenizer, lookup, reverse_rows
from grimoire.rows.prompts import tokenize_grpo

sys.path.insert(0, str(Path(__file__).parent))
from agentic_warm_start import warm_start

WINDOW = 10


def main(sft_steps: int, rl_steps: int, engine: str, lr: float, rewards: list[str]) -> None:
    torch.set_num_threads(1)
    tok = build_tokenizer()
    out = Path(tempfile.mkdtemp(prefix="agentic_lookup_"))
    start = time.perf_counter()
    model = warm_start(sft_steps, tok, str(out / "sft")).train()
    print(f"SFT warm start: {sft_steps} steps in {time.perf_counter() - start:.0f}s")
    prompts = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(4096, seed=7)]
    method = GRPOMethod(
        rewards,
        num_generations=8,
        max_new_tokens=32,
        temperature=1.0,
        engine=engine,
        tools=[lookup],
        tool_call_parser="tiny",
        stop_tokens=["<|end|>"],
        max_turns=3,
        max_episode_tokens=224,
    )
    config = TrainingConfig(
        output_dir=str(out / "grpo"),
        max_steps=rl_steps,
        batch_size=8,
        learning_rate=lr,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        weight_decay=0.0,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        seed=0,
        disable_dropout=True,
        max_length=256,
    )
    start = time.perf_counter()
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=method, train_dataset=prompts
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    print(f"GRPO ({engine}): {rl_steps} steps in {time.perf_counter() - start:.0f}s")
    log = out / "grpo" / "metrics.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    c = bench.tool_task_curve(rows, WINDOW)
    w = int(c["w"])
    print(f"steps logged: {int(c['steps'])}; metrics: {log}")
    print(f"success (exact match), first {w} steps: {c['rate_first']:.3f}")
    print(f"success (exact match), last {w} steps:  {c['rate_last']:.3f}")
    print(f"tool calls ok per step, first/last {w}: {c['calls_first']:.1f} / {c['calls_last']:.1f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]) if args else 750,
        int(args[1]) if len(args) > 1 else 60,
        args[2] if len(args) > 2 else "hf",
        float(args[3]) if len(args) > 3 else 1e-4,
        args[4].split(",") if len(args) > 4 else ["exact_match"],
    )
