"""Run a short SFT job; launched with 1 process or under `accelerate launch --num_processes 2`.

Usage: ddp_sft.py MODEL_DIR OUT_DIR PER_DEVICE_BATCH GRAD_ACCUM [EXTRA_CONFIG_JSON]
Writes OUT_DIR/params.pt (rank 0) and OUT_DIR/metrics.jsonl. EXTRA_CONFIG_JSON's "loss":
"docs_minimal" trains docs/custom-loss.md's MinimalLoss instead of SFTLoss. A JSON list of
such objects runs each in turn in this process (and process group), into OUT_DIR/case<i>/:
one launch for several settings.
"""

import json
import sys
from pathlib import Path

import torch
from tests.helpers.doc_methods import docs_minimal_loss
from tests.helpers.train_utils import quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer
from grimoire.data import tokenize_sft
from grimoire.losses import SFTLoss
from grimoire.model.tiny import reverse_rows


def run(model_dir: str, out_dir: str, batch: int, accum: int, extra: dict) -> GrimoireTrainer:
    """3 steps of SFT with ``extra`` settings; rank 0 writes the trained weights."""
    extra = dict(extra)
    loss_fn = docs_minimal_loss()() if extra.pop("loss", "sft") == "docs_minimal" else SFTLoss()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(48, seed=5, max_len=9)]
    config = quiet_config(
        out_dir,
        max_steps=3,
        batch_size=batch,
        gradient_accumulation_steps=accum,
        learning_rate=1e-2,
        **extra,
    )
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=tok,
        config=config,
        loss_fn=loss_fn,
        train_dataset=rows,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        model = trainer.unwrapped_model
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if trainer.step_hooks:  # OSFT: compare the dense weights users get
            state = {
                k: v.detach().cpu() for k, v in trainer.step_hooks[0].export_state_dict({}).items()
            }
        torch.save(state, f"{out_dir}/params.pt")
    return trainer


model_dir, out_dir, batch, accum = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
given = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
torch.set_num_threads(1)
if isinstance(given, list):
    for i, extra in enumerate(given):
        trainer = run(model_dir, str(Path(out_dir, f"case{i}")), batch, accum, extra)
else:
    trainer = run(model_dir, out_dir, batch, accum, given)
trainer.close()
if isinstance(given, list) and trainer.accelerator.num_processes > 1:
    # A trainer after close() under a launcher: refused with a message (it used to fail deep in
    # DDP, or hang under FSDP2); OUT_DIR/after_close.rank<r>.txt.
    rank = trainer.accelerator.process_index
    try:
        run(model_dir, str(Path(out_dir, "after_close")), batch, accum, {})
        said = "trained"
    except RuntimeError as err:
        said = str(err)
    Path(out_dir, f"after_close.rank{rank}.txt").write_text(said)
