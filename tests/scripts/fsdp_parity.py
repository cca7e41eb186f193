"""Three optimizer steps of one method under DDP or FSDP2 (or one process), for parity tests.

Usage: ``fsdp_parity.py TINY_DIR OUT_DIR FAMILY DISTRIBUTED BATCH ACCUM [RESUME_STEPS]``.
Writes ``OUT_DIR/result.rank<r>.json`` (losses per step, and for every trainable parameter its
type, full shape and the shape this process holds) and, from rank 0, ``OUT_DIR/params.pt`` (full
weights, gathered); the ``EXPORTED`` families also write ``OUT_DIR/export`` (``save_model``, the
``from_pretrained`` export; ``sft_untied``: SFT of the tiny Llama with untied embeddings).
``RESUME_STEPS``: stop after that many steps with a checkpoint (the resume
test then runs again with ``resume_from_checkpoint``). ``PARITY_CONFIG``: JSON config overrides.
``DISTRIBUTED`` may list several layouts (``fsdp2,ddp``): each runs every family, one launch for
all, into ``OUT_DIR/<layout>/<family>``. ``SAVE_SFT_AT=S``: the ``sft`` family also writes a
checkpoint at step ``S`` and goes on (the resume tests start from it). ``MUON_SHARDED=1``: after
the families, :func:`tests.scripts.muon_sharded.main` on the same process group.
``THEN_RESUME=DIR[,DIR...]``: then, on the same group and layout, resume each ``DIR/sft``'s
latest checkpoint to step 3 (checkpoints written on other world sizes or layouts).

``FUSED_CHUNK=N`` builds the loss with ``fused_chunk_size=N``; ``VOCAB=V`` records, with a
TorchDispatchMode around training, the most rows of any float tensor whose last dim is ``V``
(the largest logits block), and the ``grimoire.forward.logprobs`` log lines.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
from benchmarks.common import vocab_peak

from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.data import tokenize_preference, tokenize_sft
from grimoire.losses import DPOLoss, ORPOLoss, SFTLoss
from grimoire.model.tiny import build_model, preference_rows, reverse_rows
from grimoire.parallel.fsdp import full_state_dict, is_sharded

#: Total optimizer steps of a run (``TOTAL_STEPS`` overrides), and an optional signal a callback
#: sends to its own process: ``SIGNAL_AT="STEP:SIGNAME:RANK"`` (preemption tests).
TOTAL = int(os.environ.get("TOTAL_STEPS", "3"))
#: Families whose trained model is also exported with ``save_model`` (tied and untied embeddings).
EXPORTED = ("sft", "sft_untied")


class SignalAt(TrainerCallback):
    def __init__(self, spec: str) -> None:
        step, name, rank = spec.split(":")
        self.step, self.signal, self.rank = int(step), getattr(signal, name), int(rank)

    def on_step_end(self, trainer, step, loss, metrics):
        if step == self.step and trainer.accelerator.process_index == self.rank:
            os.kill(os.getpid(), self.signal)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, trainer, step, loss, metrics):
        self.losses.append(loss)


def _mesh(param) -> dict | None:
    """A DTensor's device mesh: its dimension names and the ranks it lays out."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return None
    return {"dims": list(mesh.mesh_dim_names or ()), "ranks": mesh.mesh.tolist()}


def main(
    tiny_dir: str,
    out: str,
    family: str,
    distributed: str,
    batch: int,
    accum: int,
    stop_after: int | None = None,
    resume: bool = False,
) -> GrimoireTrainer:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if family == "sft_untied":  # the same tiny Llama (seed 0) with its own lm_head
        model = build_model(
            "llama", seed=0, vocab_size=model.config.vocab_size, tie_word_embeddings=False
        )
    if family == "sft_tied":  # one tensor for the input embedding and the LM head
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    extra: dict = {}
    peft_config = None
    chunk = {"fused_chunk_size": int(os.environ.get("FUSED_CHUNK", "1024"))}
    if family in ("dpo", "orpo"):
        rows = [tokenize_preference(r, tok, max_length=64) for r in preference_rows(32, seed=4)]
        if family == "dpo":
            loss = DPOLoss(ref_model=copy.deepcopy(model), **chunk)
        else:
            loss = ORPOLoss(**chunk)
    elif family == "grpo":  # a fixed-completion engine: every layout sees the same samples
        from tests.scripts.online_invariance import FixedEngine, reward

        from grimoire.losses.grpo import GRPOMethod
        from grimoire.rows.prompts import tokenize_grpo

        rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(8, seed=9)]
        engine = FixedEngine(max_new_tokens=4, temperature=1.0)
        loss = GRPOMethod(
            [reward],
            beta=0.05,
            ref_model="copy",
            engine=engine,
            num_generations=4,
            max_new_tokens=4,
        )
    else:
        rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(48, seed=5, max_len=9)]
        loss = SFTLoss(**chunk)
    if family == "lora":  # with activation checkpointing composed with the sharding
        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        extra = {"gradient_checkpointing": True}
    if family == "sft_bf16":  # FSDP2's MixedPrecisionPolicy: what does a layer compute with?
        extra = {"mixed_precision": "bf16"}
        seen: list[str] = []
        q_proj = model.model.layers[0].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
    if family == "osft":
        extra = {"osft": True, "osft_unfreeze_rank_ratio": 0.5}
    if family == "muon":  # Newton-Schulz on each whole matrix, AdamW on the rest
        extra = {"optimizer": "muon", "learning_rate": 1e-3, "muon_learning_rate": 0.02}
    extra = {
        "gradient_checkpointing": False,
        "mixed_precision": "no",
        "optimizer": "sgd",
        "learning_rate": 0.2,
        **extra,
    }
    # SAVE_SFT_AT: SFT also checkpoints at that step and goes on (the resume tests' start).
    save_at = int(os.environ.get("SAVE_SFT_AT", 0)) if family == "sft" else 0
    config = TrainingConfig(
        output_dir=out,
        max_steps=stop_after or TOTAL,
        batch_size=batch,
        gradient_accumulation_steps=accum,
        weight_decay=0.0,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        distributed=distributed,
        max_tokens_per_device=96,
        save_steps=stop_after or save_at or None,
        disable_dropout=True,
        save_total_limit=None,
        checkpoint_signals=["SIGTERM", "SIGUSR1"],
        resume_from_checkpoint="latest" if resume else None,
        **extra,
    )
    # PARITY_CONFIG: JSON overrides of the config (tests/test_fsdp2.py HSDP: the shard group size).
    config = TrainingConfig(
        **{**config.to_dict(), **json.loads(os.environ.get("PARITY_CONFIG", "{}"))}
    )
    if resume:
        config = TrainingConfig(**{**config.to_dict(), "max_steps": TOTAL, "save_steps": None})
    record = Losses()
    callbacks = [record] + (
        [SignalAt(os.environ["SIGNAL_AT"])] if "SIGNAL_AT" in os.environ else []
    )
    trainer = GrimoireTrainer(
        model, tok, config, loss, rows, peft_config=peft_config, callbacks=callbacks
    )
    if family == "sft_bf16":
        seen.clear()
    peak, lines = vocab_peak(int(os.environ.get("VOCAB", "0"))), Lines()
    logging.getLogger("grimoire.forward.logprobs").addHandler(lines)
    logging.getLogger("grimoire.forward.logprobs").setLevel(logging.INFO)
    with peak if peak.vocab else contextlib.nullcontext():
        trainer.train()
    logging.getLogger("grimoire.forward.logprobs").removeHandler(lines)
    rank = trainer.accelerator.process_index
    shards = {
        name: {
            "type": type(p).__name__,
            "dtype": str(p.dtype),
            "full": list(p.shape),
            "local": list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape),
            "placements": [repr(x) for x in getattr(p, "placements", ())],  # 1 per mesh dim
            "mesh": _mesh(p),
        }
        for name, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    ref = getattr(getattr(loss, "reference", None), "ref_model", None)
    # HSDP: a frozen reference is sharded on the policy's mesh (the same object, same groups).
    ref_params = list(ref.parameters()) if ref is not None else []
    policy_mesh = getattr(next(trainer.model.parameters()), "device_mesh", None)
    result = {
        "losses": record.losses,
        "sharded": is_sharded(trainer.model),
        "reference_sharded": ref is not None and is_sharded(ref),
        "reference_placements": sorted({str(getattr(p, "placements", None)) for p in ref_params}),
        "reference_on_policy_mesh": bool(ref_params)
        and all(getattr(p, "device_mesh", None) is policy_mesh for p in ref_params),
        "steps": trainer.global_step,
        "preempted_by": trainer.preempted_by,
        "forward_weight_dtypes": sorted(set(seen)) if family == "sft_bf16" else None,
        "params": shards,
        "vocab_peak_rows": peak.rows,
        "fused_log": lines.lines,
    }
    Path(out, f"result.rank{rank}.json").write_text(json.dumps(result))
    model = trainer.model
    state = full_state_dict(model) if is_sharded(model) else trainer.unwrapped_model.state_dict()
    if rank == 0:
        if trainer.step_hooks:  # OSFT: compare the dense weights users get
            state = trainer.step_hooks[0].export_state_dict(state)
        state = {k: v.detach().cpu().clone() for k, v in state.items()}
        torch.save(state, Path(out, "params.pt"))
    if family in EXPORTED:  # every rank takes part (FSDP2 gathers), the main process writes
        trainer.save_model(Path(out, "export"))
    return trainer


if __name__ == "__main__":
    args = sys.argv[1:]
    stop = int(args[6]) if len(args) > 6 and args[6] != "resume" else None
    trainer = None
    layouts, batching = args[3].split(","), (int(args[4]), int(args[5]))
    for layout in layouts:
        root = Path(args[1], layout) if len(layouts) > 1 else Path(args[1])
        for fam in args[2].split(","):  # several families in one launch: one group start-up
            trainer = main(
                args[0],
                str(root / fam),
                fam,
                layout,
                *batching,
                stop,
                resume=len(args) > 6 and args[6] == "resume",
            )
    for folder in filter(None, os.environ.get("THEN_RESUME", "").split(",")):
        trainer = main(
            args[0], str(Path(folder, "sft")), "sft", layouts[-1], *batching, resume=True
        )
    if os.environ.get("MUON_SHARDED"):
        from tests.scripts import muon_sharded

        muon_sharded.main(args[0], args[1])
    if trainer is not None:
        trainer.close()
