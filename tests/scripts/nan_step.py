"""SFT with a NaN injected into one step's loss (so into its gradients) on one rank.

Usage: nan_step.py MODEL_DIR OUT_DIR BAD_STEPS_JSON BAD_RANK EXTRA_CONFIG_JSON
Launched with 1 process or under `accelerate launch` (DDP, FSDP2 or a DeepSpeed config). Writes
OUT_DIR/params_<rank>_<step>.pt after every step (the full weights: ZeRO-3 partitions gathered),
and OUT_DIR/result_<rank>.json (skipped steps, the optimizer's own step count, or the DeepSpeed
engine's skipped-step count, the learning rates, the error message if the run stopped).
"""

import contextlib
import json
import sys

import torch
from tests.helpers.train_utils import quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer, TrainerCallback
from grimoire.data import tokenize_sft
from grimoire.losses import SFTLoss
from grimoire.model.tiny import reverse_rows
from grimoire.parallel.deepspeed import is_engine
from grimoire.training.guard import TrainingDiverged


class NaNLoss(SFTLoss):
    """SFT whose loss is NaN on rank ``rank``'s first micro-batch of the 1-based steps ``bad``."""

    def __init__(self, bad: list[int], rank: int, accum: int):
        super().__init__()
        self.bad, self.rank, self.accum, self.calls = set(bad), rank, accum, 0

    def __call__(self, model, batch, training=True):
        loss, metrics = super().__call__(model, batch, training=training)
        if training:
            step, micro = divmod(self.calls, self.accum)
            self.calls += 1
            if step + 1 in self.bad and micro == 0 and self.here:
                loss = loss * float("nan")
        return loss, metrics


class Snapshots(TrainerCallback):
    def __init__(self, out, rank):
        self.out, self.rank, self.lrs = out, rank, []

    def on_step_end(self, trainer, step, loss, metrics):
        model = trainer.unwrapped_model
        with gathered(trainer.model):
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        torch.save(state, f"{self.out}/params_{self.rank}_{step}.pt")
        self.lrs.append(trainer.scheduler.get_last_lr()[0])


def gathered(model):
    """ZeRO-3's partitioned weights gathered whole for the read (a collective: every rank)."""
    if not is_engine(model) or model.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.module.parameters()))


model_dir, out_dir = sys.argv[1], sys.argv[2]
bad, bad_rank, extra = json.loads(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(model_dir)
rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(48, seed=5, max_len=9)]
config = quiet_config(
    out_dir,
    max_steps=4,
    batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    lr_scheduler="linear",
    **extra,
)
loss_fn = NaNLoss(bad, bad_rank, 2)
trainer = GrimoireTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    tokenizer=tok,
    config=config,
    loss_fn=loss_fn,
    train_dataset=rows,
)
rank = trainer.accelerator.process_index
loss_fn.here = rank == bad_rank
snaps = Snapshots(out_dir, rank)
trainer.callbacks.add(snaps)
error = None
try:
    trainer.train()
except TrainingDiverged as exc:
    error = str(exc)
if is_engine(trainer.model):  # the engine's own counts: steps taken, steps it skipped
    optim_steps = [trainer.model.global_steps - trainer.model.skipped_steps]
    engine_skipped = trainer.model.skipped_steps
else:
    optim_steps = [s["step"] for s in trainer.optimizer.optimizer.state_dict()["state"].values()]
    engine_skipped = None
result = {
    "skipped_steps": trainer.state.skipped_steps,
    "global_step": trainer.global_step,
    "optimizer_steps": sorted({float(s) for s in optim_steps}),
    "engine_skipped_steps": engine_skipped,
    "lrs": snaps.lrs,
    "error": error,
}
with open(f"{out_dir}/result_{rank}.json", "w") as f:
    json.dump(result, f)
trainer.close()
