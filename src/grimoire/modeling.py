"""Model and runtime set-up the trainer applies before training (kept out of the loop file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator

from .config import TrainingConfig


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing, non-reentrant: it needs no input grads, so it also works with
    frozen embeddings under LoRA. transformers 5 renamed the API; accept both names."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability, including attention dropout read from module attributes."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout_p"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    for attr in (
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
    ):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)


def pad_token_id_of(tokenizer: Any, model: torch.nn.Module) -> int:
    for source in (tokenizer, getattr(model, "config", None)):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, int):
                return value
    return 0


def has_accelerator() -> bool:
    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def reset_accelerate_state() -> None:
    """Let a process build several trainers with different precision (notebooks, sweeps, tests).

    accelerate keeps a process-wide singleton that refuses a second mixed-precision setting; the
    per-process distributed part (PartialState) is kept, only the per-run part is cleared.
    """
    from accelerate.state import AcceleratorState, GradientState

    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()


def configure_deepspeed(accelerator: Accelerator, config: TrainingConfig) -> None:
    """DeepSpeed sizes its engine from a DataLoader we do not give accelerate: fill it in.

    Our loop already accumulates gradients itself (one engine step per optimizer step), so
    DeepSpeed's own accumulation stays at 1. Unverified here (no GPU / DeepSpeed on this machine).
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = config.batch_size
    ds["gradient_accumulation_steps"] = 1
    ds.pop("train_batch_size", None)


def truncate_row(row: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """Cut every token-aligned list column of ``row`` to ``max_tokens`` (opt-in truncation)."""
    cols = [k for k in row if k.endswith(("input_ids", "labels", "attention_mask", "position_ids"))]
    return {k: (v[:max_tokens] if k in cols else v) for k, v in row.items()}


def count_tokens(batch: Mapping[str, Any]) -> float:
    """Real (non-pad) input tokens in a collated batch, over every ``*input_ids`` column."""
    total = 0.0
    for key, value in batch.items():
        if key.endswith("input_ids") and isinstance(value, torch.Tensor):
            mask = batch.get(key.replace("input_ids", "attention_mask"))
            total += float(mask.sum()) if isinstance(mask, torch.Tensor) else float(value.numel())
    return total
