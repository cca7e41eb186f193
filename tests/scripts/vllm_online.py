"""Worker: GRPO with a colocated vLLM engine per rank, ``python vllm_online.py MODEL OUT BATCH
[ENGINE]`` (1 process) or under ``accelerate launch`` (2 processes, gloo); ENGINE: the method's
``engine`` as JSON (default ``"vllm"``; e.g. a ``vllm-server`` mapping with its url). Writes, per rank, the weight
syncs, the prompts it sampled, and the gap between vLLM's log-probs and the policy's after
training; the trainer writes metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS, G = 3, 4


def main(model_dir: str, out_dir: str, batch: int, engine_spec: str = '"vllm"') -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import reverse_rows
    from grimoire.rows.prompts import tokenize_grpo

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(32, seed=5)]
    config = TrainingConfig(
        output_dir=out_dir,
        max_steps=STEPS,
        batch_size=batch,
        learning_rate=3e-3,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        disable_dropout=True,
        seed=0,
    )
    method = GRPOMethod(
        ["char_match"], num_generations=G, max_new_tokens=6, engine=json.loads(engine_spec)
    )
    sampled: list[list[str]] = []
    build = method.build_batches

    def recording(ctx, groups):
        sampled.append([p for g in groups for p in g.prompts["prompt"]])
        return build(ctx, groups)

    method.build_batches = recording  # the stage calls the method's build_batches
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=rows,
    )
    trainer.train()
    engine = method.engine
    syncs_in_training = engine.syncs
    rank = trainer.accelerator.process_index
    mine = [r["prompt_input_ids"] for r in rows[rank * 2 : rank * 2 + 2]]
    rollout = engine.generate(mine, G)  # syncs the last step's weights, then samples
    mask = rollout.completion_mask.bool()
    gap = float((rollout.old_logps - rollout.sampler_logps).abs()[mask].max())
    named = dict(trainer.unwrapped_model.named_parameters())
    params = {n: p.detach().double().sum().item() for n, p in named.items()}
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in named.items())
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world": trainer.accelerator.num_processes,
                "syncs_in_training": syncs_in_training,
                "syncs": engine.syncs,
                "sampled": sampled,
                "gap": gap,
                "params": params,
                "moved": moved,
            }
        )
    )
    trainer.close()  # shuts vLLM down first, leaving the group for the trainer to destroy


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
