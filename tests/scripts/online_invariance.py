"""One optimizer step of each online method on the same global batch of 4 prompts, split as
``batch_size x gradient_accumulation_steps`` per process (run under a launcher for 2 processes).

Sampling is replaced by a deterministic engine (completions are a fixed function of the prompt
and the sample's index), so every split sees the same completions and any difference comes from
how statistics and normalisers treat the split. Usage:
``online_invariance.py TINY_DIR OUT_DIR BATCH ACCUM``; writes
``OUT_DIR/<config>.rank<r>.json`` (advantages per prompt, the step's loss) and, from rank 0,
``OUT_DIR/<config>.params.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from grimoire.parallel.fsdp import full_state_dict, is_sharded
from grimoire.rollout.engines.base import RolloutEngine

G, MAX_NEW = 4, 4


class FixedEngine(RolloutEngine):
    """Completion ``j`` of prompt ``p``: a fixed token sequence of length 1..MAX_NEW."""

    def _sample(self, prompts: list[list[int]], n: int, greedy: bool) -> list[list[int]]:
        out = []
        for p in prompts:
            for j in range(n):
                seed = sum(p) * 31 + j * 17
                length = 1 + (seed + j) % MAX_NEW
                out.append([4 + (seed + 7 * k) % 56 for k in range(length)])
        return out


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [len(c) + (sum(map(ord, c)) % 13) / 13 for c in completions]


def methods() -> dict[str, Any]:
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.losses.online_dpo import OnlineDPOMethod
    from grimoire.losses.raft import RAFTMethod
    from grimoire.losses.rloo import RLOOMethod

    def engine():
        return FixedEngine(max_new_tokens=MAX_NEW, temperature=1.0)

    common = dict(num_generations=G, max_new_tokens=MAX_NEW)
    out: dict[str, Any] = {}
    for loss_type, scale in [
        ("dapo", "group"),
        ("dapo", "batch"),
        ("dapo", "none"),
        ("grpo", "batch"),
        ("dr_grpo", "batch"),
    ]:
        out[f"grpo-{loss_type}-{scale}"] = lambda lt=loss_type, sc=scale: GRPOMethod(
            [reward],
            loss_type=lt,
            scale_rewards=sc,
            beta=0.05,
            ref_model="copy",
            engine=engine(),
            **common,
        )
    for norm in (False, True):
        out[f"rloo-norm{int(norm)}"] = lambda n=norm: RLOOMethod(
            [reward], normalize_advantages=n, ref_model="copy", engine=engine(), **common
        )
    out["online_dpo"] = lambda: OnlineDPOMethod(
        [reward], ref_model="copy", engine=engine(), **common
    )
    out["raft"] = lambda: RAFTMethod([reward], engine=engine(), **common)
    return out


def run(tiny_dir: str, out_dir: str, batch: int, accum: int, names: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
    from grimoire.model.tiny import reverse_rows
    from grimoire.rows.prompts import tokenize_grpo

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(4, seed=9)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = None
    for name in names:
        method = methods()[name]()
        advantages: dict[str, list[float]] = {}
        build = method.build_batches

        def recording(ctx, groups, build=build, advantages=advantages):
            batches, metrics = build(ctx, groups)
            for group, b in zip(groups, batches):
                if "advantages" in b:
                    adv = b["advantages"].reshape(-1, G).tolist()
                    for prompt, a in zip(group.prompts["prompt"], adv):
                        advantages[prompt] = a
            return batches, metrics

        method.build_batches = recording

        class Loss(TrainerCallback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_step_end(self, trainer, step, loss, metrics):
                self.losses.append(loss)

        record = Loss()

        config = TrainingConfig(
            output_dir=str(out / name),
            max_steps=1,
            batch_size=batch,
            gradient_accumulation_steps=accum,
            optimizer="sgd",
            learning_rate=0.5,
            weight_decay=0.0,
            max_grad_norm=None,
            mixed_precision="no",
            gradient_checkpointing=False,
            progress_bar=False,
            save_on_epoch_end=False,
            disable_dropout=True,
            lr_scheduler="constant",
            warmup_ratio=0.0,
            distributed=os.environ.get("INVARIANCE_DISTRIBUTED", "ddp"),
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_dir)
        trainer = GrimoireTrainer(model, tok, config, method, rows, callbacks=[record])
        trainer.train()
        rank = trainer.accelerator.process_index
        (out / f"{name}.rank{rank}.json").write_text(
            json.dumps({"advantages": advantages, "loss": record.losses[0]})
        )
        model = trainer.unwrapped_model
        if is_sharded(model):  # gathered on every rank (a collective), kept by rank 0
            params = {
                k: v
                for k, v in full_state_dict(model).items()
                if k in dict(model.named_parameters())
            }
        else:
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
        if rank == 0:
            torch.save(params, out / f"{name}.params.pt")
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), list(methods()))
