"""Three optimizer steps of SFT and DPO under DeepSpeed ZeRO or DDP, for tests/test_deepspeed.py.

Usage: ``deepspeed_parity.py TINY_DIR OUT_DIR FAMILIES [resume]``, launched on 2 processes by
``accelerate launch`` (a DeepSpeed config selects ZeRO-2 or ZeRO-3, ``--multi_gpu`` DDP).
``FAMILIES``: comma-separated ``sft`` / ``dpo`` (DPO with a frozen reference model).

Each run checkpoints at step 2 and goes on to step 3, writing into ``OUT_DIR/FAMILY/``:
``result.rank<r>.json`` (losses and grad norms per step, the steps they were logged at, the
final evaluation, the wrapper types, how much of each weight this process holds), and from rank
0 ``params.pt`` (the full trained weights, read back from the trainer's own ``save_model``
export in ``export/``). ``resume``: after each run, a fresh trainer in the same launch (a model
loaded from TINY_DIR, a new engine) resumes from ``OUT_DIR/FAMILY/checkpoint-2`` to step 3 and
writes the same files into ``OUT_DIR/FAMILY/resumed/``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.data import tokenize_preference, tokenize_sft
from grimoire.losses import DPOLoss, SFTLoss
from grimoire.model.tiny import preference_rows, reverse_rows

#: Optimizer steps of a run, and the step its checkpoint is written at.
TOTAL, SAVE_AT = 3, 2


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.eval: dict[str, float] = {}

    def on_step_end(self, trainer, step, loss, metrics):
        self.steps.append(step)
        self.losses.append(loss)
        self.grad_norms.append(trainer._last_grad_norm)

    def on_evaluate(self, trainer, metrics):
        self.eval = dict(metrics)


def held(module: torch.nn.Module | None) -> float | None:
    """The fraction of the weights this process holds (ZeRO-3 keeps ``ds_tensor`` partitions)."""
    if module is None:
        return None
    params = list(module.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    return local / full


def load(tiny_dir: str, family: str) -> tuple[Any, Any, list[dict]]:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if family == "dpo":
        rows = [tokenize_preference(r, tok, max_length=64) for r in preference_rows(32, seed=4)]
        return model, DPOLoss(ref_model=copy.deepcopy(model)), rows
    rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(48, seed=5, max_len=9)]
    return model, SFTLoss(), rows


def train(tiny_dir: str, out: Path, model: Any, loss: Any, rows: list, resume: bool) -> Any:
    # AdamW: its state (moments, step count) must survive the checkpoint for an exact resume.
    # Its epsilon at 1e-6: with 1e-8 an element whose gradient is ~1e-9 moves by lr x
    # (rounding noise / 1e-8), and DDP and ZeRO sum gradients in different orders (seen: 1.4e-5
    # on single elements of a DPO run whose losses agree to 1e-7).
    # A linear decay: the schedule must too. max_grad_norm 0.2 clips every step, so DeepSpeed's
    # clipping is compared with torch's; 2 micro-batches per step accumulate across backwards.
    config = TrainingConfig(
        output_dir=str(out / "resumed" if resume else out),
        max_steps=TOTAL,
        batch_size=2,
        gradient_accumulation_steps=2,
        optimizer="adamw",
        learning_rate=1e-3,
        weight_decay=0.01,
        adam_epsilon=1e-6,
        max_grad_norm=0.2,
        lr_scheduler="linear",
        warmup_ratio=0.0,
        save_steps=SAVE_AT,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        disable_dropout=True,
        gradient_checkpointing=False,
        mixed_precision="no",
        resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}") if resume else None,
    )
    record = Record()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    # 7 evaluation rows: the ranks get unequal shares, and ZeRO-3's forwards stay collective.
    trainer = GrimoireTrainer(model, tok, config, loss, rows, rows[:7], callbacks=[record])
    trainer.train()
    folder = Path(config.output_dir)
    ref = getattr(getattr(loss, "reference", None), "ref_model", None)
    result = {
        "logged_steps": record.steps,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "eval": record.eval,
        "steps": trainer.global_step,
        "wrapper": type(trainer.model).__name__,
        "reference_wrapper": None if ref is None else type(ref).__name__,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "held": held(trainer.model),
        "reference_held": held(ref),
    }
    rank = trainer.accelerator.process_index
    (folder / f"result.rank{rank}.json").write_text(json.dumps(result))
    trainer.save_model(folder / "export")  # every rank takes part (ZeRO-3 gathers)
    if rank == 0:
        torch.save(load_file(folder / "export" / "model.safetensors"), folder / "params.pt")
    return trainer


if __name__ == "__main__":
    tiny, root, families = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    resume = sys.argv[4:] == ["resume"]
    torch.set_num_threads(1)
    # Every model is loaded before the first trainer exists, the resumed runs' too, as in a
    # one-run script: once an Accelerator holds a ZeRO-3 config, transformers' from_pretrained
    # builds models already partitioned (accelerate registers the config with transformers).
    # Each family's resumed run comes right after the run whose checkpoint it reads.
    kinds = (False, True) if resume else (False,)
    runs = [(family, resumed) for family in families for resumed in kinds]
    loaded = [load(tiny, family) for family, _ in runs]
    trainer = None
    for (family, resumed), (model, loss, rows) in zip(runs, loaded, strict=True):
        trainer = train(tiny, root / family, model, loss, rows, resumed)
    # close() only after the last trainer: a trainer built after it is refused under a launcher.
    if trainer is not None:
        trainer.close()
    # Every result and export is on disk. Under load, ZeRO-3 still sometimes aborts during
    # interpreter finalisation ("terminate called without an active exception": gloo's threads
    # releasing the last all-gather; see release_at_exit), which is not what this script checks:
    # leave without finalising, after flushing what was printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
