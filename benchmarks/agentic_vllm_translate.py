"""A tool task that learns with the colocated vLLM engine on the CPU.

vLLM's CPU build has no attention kernel for the default tiny Llama's 16-wide heads, so this run
uses the vLLM tests' shape (hidden 128, two 64-wide heads). That model reverses the bundled
``lookup`` task's words well on its own (no reason to call the tool), so the task here is one no
model can work out: ``translate abc=`` -> a keyed hash of ``abc`` that only the ``translate``
tool (defined here) knows. The warm start is SFT'd (HF) on a mix: half the conversations call
the tool and copy its result, half answer at once (always wrong on an unseen word). GRPO then
plays episodes sampled by vLLM (``engine: vllm``) and rewards the exact answer: calling pays.
Printed: the warm start's sampled play, then the success rate and the tool calls per step from
``metrics.jsonl``, and held-out greedy success before and after (the trainer's eval).

    PYTHONPATH=src VLLM_LOGGING_LEVEL=WARNING /path/to/vllm-venv/bin/python \
        benchmarks/agentic_vllm_translate.py [SFT_STEPS] [RL_STEPS] [LR] [ENGINE]
"""

from __future__ import annotations

import hashlib
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer, TrainingConfig

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench
from grimoire.losses import SFTLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_tokenizer, letter_rows, save_tiny
from grimoire.rows.prompts import tokenize_grpo
from grimoire.rows.sft import tokenize_sft

VLLM_SHAPE = dict(hidden_size=128, num_layers=2, num_attention_heads=2, num_key_value_heads=2)
WINDOW = 10


def translate(word: str) -> str:
    """The word in the toy language (a dictionary only this tool holds).

    Args:
        word: the word to translate
    """
    digest = hashlib.sha256(word.encode()).digest()
    return "".join(string.ascii_lowercase[b % 12] for b in digest[: len(word)])


SCHEMA = {
    "type": "function",
    "function": {
        "name": "translate",
        "description": "The word in the toy language (a dictionary only this tool holds).",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "description": "the word to translate"}},
            "required": ["word"],
        },
        "return": {"type": "string"},
    },
}


def prompt_rows(n: int, seed: int) -> list[dict[str, str]]:
    rows = []
    for r in letter_rows("copy", n, seed):  # any letter task's words; the answer is replaced
        word = r["prompt"][len("copy ") : -1]
        rows.append({"prompt": f"translate {word}=", "answer": translate(word)})
    return rows


def chat_rows(n: int, seed: int, tool_share: float) -> list[dict[str, Any]]:
    rng = random.Random(seed + 3)
    out = []
    for r in prompt_rows(n, seed):
        word = r["prompt"][len("translate ") : -1]
        call = {"type": "function", "function": {"name": "translate", "arguments": {"word": word}}}
        messages: list[dict[str, Any]] = [{"role": "user", "content": r["prompt"]}]
        if rng.random() < tool_share:
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "translate", "content": r["answer"]},
            ]
        messages.append({"role": "assistant", "content": r["answer"]})
        out.append({"messages": messages, "tools": [SCHEMA]})
    return out


def warm_start(steps: int, tok, out: Path) -> Path:
    start = save_tiny(out / "init", seed=0, **VLLM_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(start)
    rows = [tokenize_sft(r, tok, 128) for r in chat_rows(steps * 16, seed=0, tool_share=0.5)]
    config = TrainingConfig(
        output_dir=str(out / "sft"),
        batch_size=16,
        learning_rate=1.5e-3,
        lr_scheduler="cosine",
        warmup_steps=10,
        weight_decay=0.0,
        max_steps=steps,
        max_length=128,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=max(steps // 4, 1),
        seed=0,
    )
    GrimoireTrainer(
        model=model, tokenizer=tok, loss_fn=SFTLoss(), train_dataset=rows, config=config
    ).train()
    model.save_pretrained(out / "warm")
    tok.save_pretrained(out / "warm")
    return out / "warm"


def main(sft_steps: int, rl_steps: int, lr: float, engine: str) -> None:
    torch.set_num_threads(1)
    tok = build_tokenizer()
    out = Path(tempfile.mkdtemp(prefix="agentic_vllm_"))
    t0 = time.perf_counter()
    warm = warm_start(sft_steps, tok, out)
    print(f"SFT warm start ({VLLM_SHAPE}): {sft_steps} steps in {time.perf_counter() - t0:.0f}s")
    prompts = [tokenize_grpo(r, tok, max_length=64) for r in prompt_rows(4096, seed=7)]
    held = [tokenize_grpo(r, tok, max_length=64) for r in prompt_rows(64, seed=8)]
    method = GRPOMethod(
        ["exact_match"],
        num_generations=8,
        max_new_tokens=32,
        temperature=1.0,
        engine=engine,
        loss_type="dapo",
        beta=0.0,
        tools=[translate],
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
        eval_steps=rl_steps,
        eval_on_start=True,
    )
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    t0 = time.perf_counter()
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=prompts,
        eval_dataset=held,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    print(f"GRPO ({engine}): {rl_steps} steps in {time.perf_counter() - t0:.0f}s")
    records = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/rewards/exact_match_reward/mean" in r]
    c = bench.tool_task_curve(records, WINDOW)
    w = int(c["w"])
    print(f"metrics: {out / 'grpo' / 'metrics.jsonl'}")
    print(f"sampled success, first/last {w} steps: {c['rate_first']:.3f} / {c['rate_last']:.3f}")
    print(
        f"tool calls that ran per step (of 64), first/last {w}: {c['calls_first']:.1f} / "
        f"{c['calls_last']:.1f}"
    )
    for r in evals:
        print(
            f"held-out greedy success at step {r['step']}: "
            f"{r['eval/rewards/exact_match_reward/mean']:.3f}"
        )


if __name__ == "__main__":
    a = sys.argv[1:]
    main(
        int(a[0]) if a else 1500,
        int(a[1]) if len(a) > 1 else 60,
        float(a[2]) if len(a) > 2 else 2e-4,
        a[3] if len(a) > 3 else "vllm",
    )
