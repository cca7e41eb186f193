"""Small helpers for tests that run the trainer."""

from __future__ import annotations

import sys
from typing import Any

import torch
from accelerate import Accelerator

from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.config.context import TrainingContext
from grimoire.parallel.accelerate import reset_accelerate_state


def quiet_config(output_dir, **overrides: Any) -> TrainingConfig:
    """Deterministic, fast settings: fp32, no checkpointing, no progress bar, no saving."""
    values: dict[str, Any] = dict(
        output_dir=str(output_dir),
        num_epochs=1,
        batch_size=4,
        learning_rate=1e-3,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        warmup_ratio=0.0,
        lr_scheduler="constant",
    )
    values.update(overrides)
    return TrainingConfig(**values)


def method_context(method, model, tokenizer, rows, output_dir="/tmp/unused", **config: Any):
    """Call ``method.setup`` with the context a trainer would give it (no training loop) and
    return that :class:`TrainingContext`; ``config`` overrides :func:`quiet_config`.

    The accelerator is built on a fresh accelerate state with the config's precision, as the
    trainer builds its own: accelerate's state is a process-wide singleton, so a bare
    ``Accelerator()`` would inherit whatever an earlier trainer in the process set (after a bf16
    run, the rollout's scoring would silently autocast to bf16)."""
    training = quiet_config(output_dir, **config)
    reset_accelerate_state()
    accelerator = Accelerator(cpu=True, mixed_precision=training.mixed_precision)
    ctx = TrainingContext(training, accelerator, tokenizer, model, rows)
    method.setup(ctx)
    return ctx


class RecordLosses(TrainerCallback):
    """Collects the logged loss of every step (logging_steps=1)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.records: list[dict] = []

    def on_log(self, trainer, metrics):
        self.losses.append(metrics["loss"])
        self.records.append(dict(metrics))


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(model, tokenizer, rows, loss_fn, config, **kwargs) -> GrimoireTrainer:
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tokenizer,
        config=config,
        loss_fn=loss_fn,
        train_dataset=rows,
        **kwargs,
    )
    trainer.train()
    return trainer


def free_port() -> int:
    """A TCP port nothing listens on now: each multi-process test gets its own rendezvous port
    (reusing one right after the previous job closed it can make a worker abort)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_launch(processes: int = 2) -> list[str]:
    """``accelerate launch`` of ``processes`` CPU processes, each call on its own rendezvous
    port: ``--multi_gpu`` picks accelerate's torchrun launcher, and without GPUs the trainer forms
    a gloo group (``--cpu`` would run ONE process). Append the script and its arguments."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
