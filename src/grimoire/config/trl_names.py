"""TRL's ``TrainingArguments`` / ``DPOConfig`` / ``GRPOConfig`` names that people coming from
TRL write in a ``training:`` section, each answered with the key that does it here.

They are not accepted silently as aliases: several differ in meaning or shape (``bf16: true`` is
one value of ``mixed_precision``; ``eval_strategy: epoch`` has no step count), and a config
that says one thing and runs another is what the up-front checks exist to prevent. The error
names the exact key (and value) to write instead.
"""

from __future__ import annotations

from typing import Any


def _flag(value: Any, on: str, off: str) -> str:
    return on if value is True else off


#: TRL name -> (the key here, a function of the given value giving what to write).
TRL_NAMES: dict[str, tuple[str, Any]] = {
    "per_device_train_batch_size": ("training.batch_size", lambda v: f"batch_size: {v}"),
    "per_device_eval_batch_size": ("training.eval_batch_size", lambda v: f"eval_batch_size: {v}"),
    "train_batch_size": ("training.batch_size", lambda v: f"batch_size: {v}"),
    "num_train_epochs": ("training.num_epochs", lambda v: f"num_epochs: {v}"),
    "bf16": (
        "training.mixed_precision",
        lambda v: _flag(v, "mixed_precision: bf16", "mixed_precision: 'no' (or auto)"),
    ),
    "fp16": (
        "training.mixed_precision",
        lambda v: _flag(v, "mixed_precision: fp16", "mixed_precision: 'no' (or auto)"),
    ),
    "lr_scheduler_type": ("training.lr_scheduler", lambda v: f"lr_scheduler: {v}"),
    "optim": ("training.optimizer", lambda v: f"optimizer: {v}"),
    "report_to": ("training.log_with", lambda v: f"log_with: {v}"),
    "max_seq_length": ("training.max_length", lambda v: f"max_length: {v}"),
    "use_liger_kernel": ("training.use_liger", lambda v: f"use_liger: {v}"),
    "eval_strategy": (
        "training.eval_steps",
        lambda v: "eval_steps: <N> (evaluations are counted in optimizer steps)",
    ),
    "evaluation_strategy": (
        "training.eval_steps",
        lambda v: "eval_steps: <N> (evaluations are counted in optimizer steps)",
    ),
    "save_strategy": (
        "training.save_steps",
        lambda v: "save_steps: <N> (or save_on_epoch_end: true)",
    ),
    "logging_strategy": ("training.logging_steps", lambda v: "logging_steps: <N>"),
    "beta": ("loss.args.beta", lambda v: f"loss: {{args: {{beta: {v}}}}}"),
    "loss_type": ("loss.args.loss_type", lambda v: f"loss: {{args: {{loss_type: {v}}}}}"),
    "num_generations": (
        "loss.args.num_generations",
        lambda v: f"loss: {{args: {{num_generations: {v}}}}}",
    ),
    "max_completion_length": (
        "loss.args.max_new_tokens",
        lambda v: f"loss: {{args: {{max_new_tokens: {v}}}}}",
    ),
    "max_prompt_length": (
        "dataset.tokenize.max_prompt_length",
        lambda v: f"dataset: {{tokenize: {{max_prompt_length: {v}}}}}",
    ),
}


def trl_hint(key: str, value: Any, where: str = "training") -> str | None:
    """The problem for TRL's ``key`` given in section ``where``, naming what to write instead;
    None when ``key`` is not one of TRL's names."""
    if key not in TRL_NAMES:
        return None
    target, write = TRL_NAMES[key]
    return f"{where}.{key}: TRL's name; here it is {target}: write {write(value)}"


__all__ = ["TRL_NAMES", "trl_hint"]
