"""Count the collectives each optimizer step issues; run under a 2-process launcher.

Usage: count_collectives.py MODEL_DIR OUT_DIR. Every ``torch.distributed`` collective called from
Python (all_reduce, all_gather(_object), broadcast(_object_list), barrier, reduce_scatter, ...)
is counted; a callback snapshots the counts at every ``on_step_end``. DDP's own gradient
all-reduce runs inside its C++ reducer and is not counted: it is the data-parallel gradient sync
itself, not a host sync. Writes ``OUT_DIR/rank<r>.json``: one ``{name: count}`` per step.
"""

import collections
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tests.helpers.train_utils import quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer, TrainerCallback
from grimoire.data import tokenize_sft
from grimoire.losses import SFTLoss
from grimoire.model.tiny import reverse_rows

NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
)
counts: collections.Counter = collections.Counter()


def _counting(name, fn):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


for _name in NAMES:
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(_name, getattr(dist, _name)))


class PerStep(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, step, loss, metrics):
        self.steps.append(dict(counts))
        counts.clear()


model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(model_dir)
rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(64, seed=5, max_len=9)]
config = quiet_config(out_dir, max_steps=4, gradient_accumulation_steps=2, max_tokens_per_device=60)
per_step = PerStep()
trainer = GrimoireTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    tokenizer=tok,
    config=config,
    loss_fn=SFTLoss(),
    train_dataset=rows,
    callbacks=[per_step],
)
counts.clear()
trainer.train()
rank = trainer.accelerator.process_index
Path(out_dir).mkdir(parents=True, exist_ok=True)
Path(out_dir, f"rank{rank}.json").write_text(json.dumps(per_step.steps))
trainer.close()
