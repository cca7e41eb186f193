"""Worker: one GRPO step on tool episodes (``tools=[lookup]``, the tiny template's calls),
``python episodes_online.py MODEL OUT BATCH PACKED BUDGET`` (1 process) or under ``accelerate
launch`` (2 processes, gloo; ``EPISODES_DISTRIBUTED=fsdp2`` shards the model). The turns come
from a scripted sampler that decides each turn from the episode so far and the sample's index in
its group (never from a random stream or the rank), so one process and two see the same
episodes. Writes, per rank, the prompts it played, per micro-batch its groups and its episode
tokens, and each weight tensor's update (a sum; plain SGD, so the step's gradient)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from grimoire.rollout.engines.hf import HFGenerateEngine

G = 4


class ScriptedTurns(HFGenerateEngine):
    """Each turn is decided by the episode so far and ``k``, how many episodes with the same
    history came before it in this call (the copies of a prompt in its group are played side by
    side, so ``k`` is the sample's place among its identical copies, on any rank): on the first
    turn even ``k`` call ``lookup``, odd ``k`` answer the word's first ``k`` letters; after the
    result, ``1 + 2k`` of its letters. Old log-probs are still the policy's (the engine scores
    every sample after ``_sample``)."""

    tokenizer: Any = None
    end_id = 0

    def _sample(self, prompts, n, greedy):
        tok = self.tokenizer
        seen: Counter[tuple[int, ...]] = Counter()
        out = []
        for p in prompts:
            text = tok.decode(p)
            word = re.findall(r"reverse ([a-z]+)=", text)[-1]
            result = re.findall(r"result: ([a-z]*)<\|end\|>", text)
            for _ in range(n):
                k = seen[tuple(p)]
                seen[tuple(p)] += 1
                if result:
                    turn = result[-1][: 1 + 2 * k]
                else:
                    turn = word[:k] if k % 2 else f"call: lookup(word={word})"
                out.append(tok(turn, add_special_tokens=False)["input_ids"] + [self.end_id])
        return out


def answer_length(prompts, completions, **kwargs):
    """Varies within every group (each sample's answer has its own length): non-zero advantages."""
    return [float(len(c)) for c in completions]


def main(model_dir: str, out_dir: str, batch: int, packed: bool, budget: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import lookup, reverse_rows
    from grimoire.rows.prompts import tokenize_grpo

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(16, seed=5)]
    config = TrainingConfig(
        output_dir=out_dir,
        max_steps=1,
        batch_size=batch,
        learning_rate=1.0,
        optimizer="sgd",
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        disable_dropout=True,
        seed=0,
        padding_free=packed,
        max_tokens_per_device=budget or None,
        distributed=os.environ.get("EPISODES_DISTRIBUTED", "ddp"),
    )
    engine = ScriptedTurns(max_new_tokens=24)
    engine.tokenizer, engine.end_id = tok, tok.convert_tokens_to_ids("<|end|>")
    method = GRPOMethod(
        [answer_length],
        num_generations=G,
        engine=engine,
        tools=[lookup],
        tool_call_parser="tiny",
        stop_tokens=["<|end|>"],
        max_turns=3,
        max_episode_tokens=256,
    )
    played: list[str] = []
    micro: list[dict] = []
    build = method.build_batches

    def recording(ctx, groups):
        for g in groups:
            played.extend(g.prompts["prompt"])
        batches = build(ctx, groups)
        for g, b in zip(groups, batches[0], strict=True):
            mask = b.get("attention_mask")  # packed rows have none: every id is a real token
            tokens = int(mask.sum()) if mask is not None else int(b["input_ids"].numel())
            micro.append({"prompts": len(g.prompts["prompt"]), "tokens": tokens})
        return batches

    method.build_batches = recording  # the stage calls the method's build_batches
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=method, train_dataset=rows
    )
    trainer.train()
    # Under FSDP2 each rank holds a shard (a DTensor): gather the whole tensor.
    named = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p
        for n, p in trainer.unwrapped_model.named_parameters()
    }
    rank = trainer.accelerator.process_index
    record = {
        "world": trainer.accelerator.num_processes,
        "played": played,
        "micro": micro,
        # Plain SGD at lr 1: the update of each tensor is its gradient (summed here).
        "update": {n: (p.detach() - start[n]).double().sum().item() for n, p in named.items()},
        "moved": max(float((p.detach() - start[n]).abs().max()) for n, p in named.items()),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]))
