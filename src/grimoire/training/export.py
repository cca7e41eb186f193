"""The ``from_pretrained`` export: a loadable HF model (+ tokenizer) written by the main process,
as ``save_model`` output or inside a checkpoint (beside the DCP shards a resume reads)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import torch
from accelerate import Accelerator

from grimoire.parallel.deepspeed import is_engine, load_engine, save_engine
from grimoire.parallel.fsdp import full_state_dict, is_sharded, load_dcp, save_dcp, tie_shared
from grimoire.training.integrity import reported_write
from grimoire.training.report import note_saved_model, write_model_card


def save_hf(
    out: Any,
    accelerator: Accelerator,
    wrapped: torch.nn.Module,
    tokenizer: Any,
    hooks: list[Any],
    merge_adapter: bool = False,
) -> None:
    """Write a ``from_pretrained``-loadable model (+ tokenizer) from the main process.

    A hook that reparametrises weights (OSFT) exports dense HF weights, and for a resume keeps
    its own factors beside them so they are restored exactly.
    """
    # Every rank takes part in gathering FSDP2 / ZeRO-3 shards; only the main process writes.
    # (ZeRO-3: DeepSpeed gathers layer by layer onto rank 0; ZeRO-1/2: accelerate clones each
    # tensor out of DeepSpeed's flat buffers, which unties tied weights: tied back here.)
    if is_sharded(wrapped):
        state_dict = full_state_dict(wrapped)
    else:
        # accelerate leaves the type to inference; it is the model's state dict
        state_dict = cast(dict[str, torch.Tensor], accelerator.get_state_dict(wrapped))
    if not accelerator.is_main_process:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # A transformers model or a peft wrapper of one: duck-typed below (merge_and_unload is
    # forwarded by peft's __getattr__, so no class declares it).
    model: Any = accelerator.unwrap_model(wrapped)
    if is_engine(wrapped):
        state_dict = tie_shared(state_dict, model)
    for hook in hooks:
        if hasattr(hook, "export_state_dict"):
            state_dict = hook.export_state_dict(state_dict)
    if merge_adapter and hasattr(model, "merge_and_unload"):
        copy.deepcopy(model).merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)


def export_model(trainer: Any, out: Path, merge_adapter: bool = False) -> Path:
    """``trainer.save_model``: the HF model, its model card, and a note in the run summary."""
    acc = trainer.accelerator
    with reported_write("the model", out, trainer.config.output_dir):
        save_hf(out, acc, trainer.model, trainer.tokenizer, trainer.step_hooks, merge_adapter)
        if acc.is_main_process:
            write_model_card(trainer, out)
            note_saved_model(trainer.config.output_dir, out)
    acc.wait_for_everyone()
    return out


def write_checkpoint_model(trainer: Any, folder: Path) -> None:
    """A checkpoint's model part. The HF export and card are for people (``from_pretrained``);
    the DCP shards of model and optimizer are for resuming, on any number of processes (under
    DeepSpeed: the engine's own checkpoint, on the same number of processes)."""
    save_hf(folder, trainer.accelerator, trainer.model, trainer.tokenizer, trainer.step_hooks)
    write_model_card(trainer, folder)
    if is_engine(trainer.model):
        save_engine(folder, trainer.model)
    else:
        save_dcp(folder, trainer.model, trainer.optimizer)


def read_checkpoint_model(trainer: Any, folder: Path) -> None:
    """Restore what :func:`write_checkpoint_model` wrote for resuming: model and optimizer."""
    if is_engine(trainer.model):
        load_engine(folder, trainer.model)
    else:
        load_dcp(folder, trainer.model, trainer.optimizer)


__all__ = ["export_model", "read_checkpoint_model", "save_hf", "write_checkpoint_model"]
