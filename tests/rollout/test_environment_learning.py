"""GRPO on the bundled tiny tool task learns: from ``grimoire://assets/lookup_warm`` (SFT on a mix
of episodes that call ``lookup`` and episodes that answer without it), a short GRPO run through
the trainer's rollout stage raises the held-out success rate of greedy episodes, because calling
the tool and copying its answer pays and answering alone rarely does.

The tool is served by an MCP server process (``tests/helpers/mcp_server.py`` over stdio, its
``lookup`` only): the answer is in the tool's output, which comes from outside the trainer, so
the rise is learning to use the environment. The same task with the tool as a plain Python
function (``tools=[lookup]``) is ``examples/agentic_lookup.yaml``'s, run by
``tests/test_examples.py``; plain-function tools through the stage are also
``tests/rollout/test_environment_stage.py``'s.
"""

from __future__ import annotations

import json

import torch
from tests.helpers.commands import ROOT
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer, TrainingConfig
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import ASSETS, build_tokenizer
from grimoire.rows.prompts import tokenize_grpo

WARM = ASSETS / "lookup_warm"
MCP_LOOKUP = {"command": ["python", str(ROOT / "tests/helpers/mcp_server.py")], "tools": ["lookup"]}
EVAL = "eval/rewards/exact_match_reward/mean"


def read_jsonl(name: str, n: int) -> list[dict]:
    with (ASSETS / name).open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def grpo_lookup_run(out, seed: int, steps: int, heldout: int = 32, **tools) -> list[dict]:
    """GRPO from the bundled warm start with the lookup tool given by ``tools`` (the method's
    ``tools`` or ``mcp_servers``); the records of ``metrics.jsonl`` (greedy held-out episodes
    scored before the first step and after the last)."""
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(WARM, dtype=torch.float32)
    train = [tokenize_grpo(r, tok, max_length=64) for r in read_jsonl("lookup_prompts.jsonl", 512)]
    held = [tokenize_grpo(r, tok, max_length=64) for r in read_jsonl("lookup_eval.jsonl", heldout)]
    method = GRPOMethod(
        ["exact_match"],
        num_generations=8,
        max_new_tokens=40,
        temperature=1.0,
        loss_type="dapo",
        **tools,
        tool_call_parser="tiny",
        stop_tokens=["<|end|>"],
        max_turns=3,
        max_episode_tokens=192,
    )
    config = TrainingConfig(
        output_dir=str(out),
        max_steps=steps,
        batch_size=8,
        learning_rate=3e-4,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        weight_decay=0.0,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        eval_steps=steps,
        eval_on_start=True,
        seed=seed,
        disable_dropout=True,
        max_length=256,
    )
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=train,
        eval_dataset=held,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_the_lookup_tool_over_mcp_raises_the_success_rate(tmp_path):
    records = grpo_lookup_run(tmp_path, seed=0, steps=30, mcp_servers=[MCP_LOOKUP])
    evals = [r[EVAL] for r in records if EVAL in r]
    calls = [r.get("tools/ok", 0.0) for r in records if "rewards/exact_match_reward/mean" in r]
    assert len(evals) == 2 and len(calls) == 30, records
    before, after = evals
    # Greedy episodes on 32 held-out prompts: 0.50 before (the warm start), after 30 steps 0.69,
    # 0.94 and 0.78 with seeds 0, 1, 2 (docs/agentic.md): a rise of 4 prompts of 32 is below
    # every one of them.
    assert before <= 0.6 and after - before >= 0.125, (before, after)
    # It rises because the policy calls the tool more often: successful calls per step (of 64
    # episodes), mean of the first and of the last 5 steps, went 25.0 -> 53.4, 29.4 -> 52.8 and
    # 37.4 -> 49.8 with seeds 0, 1, 2; a 5-step mean of ~64 coin flips varies by ~2 calls.
    w = 5
    assert sum(calls[-w:]) / w >= sum(calls[:w]) / w + 8, calls
