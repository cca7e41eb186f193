"""The pieces of model preparation: activation checkpointing (decision and switch), dropout,
k-bit preparation. :func:`grimoire.training.setup.prepare_model` applies them in order."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate import Accelerator

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.model.host_memory import checkpointing_decision

logger = logging.getLogger(__name__)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing, non-reentrant: it needs no input grads, so it also works with
    frozen embeddings under LoRA. transformers 5 renamed the API; accept both names."""
    kwargs = {"use_reentrant": False}
    if callable(enable := getattr(model, "activation_checkpointing_enable", None)):
        enable(activation_checkpointing_kwargs=kwargs)
    elif callable(enable := getattr(model, "gradient_checkpointing_enable", None)):
        enable(gradient_checkpointing_kwargs=kwargs)


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


def _is_norm_module(module: torch.nn.Module) -> bool:
    # Same rule as optim's weight-decay groups: torch norms and every architecture's RMSNorm.
    return isinstance(module, torch.nn.LayerNorm | torch.nn.GroupNorm) or (
        "norm" in type(module).__name__.lower()
    )


def upcast_for_kbit(model: torch.nn.Module, mode: str) -> list[str]:
    """Cast the non-quantized half-precision parameters of a k-bit base to float32, in place.

    ``mode``: ``"all"`` (peft's ``prepare_model_for_kbit_training``: every fp16/bf16 parameter
    that is not a bitsandbytes ``Params4bit``), ``"norms"`` (only the norm layers' parameters:
    the rest stays in half precision, saving memory; norms are where low precision hurts most),
    ``"none"`` (nothing). Returns the names of the parameters it cast.
    """
    if mode not in ("all", "norms", "none"):
        raise ConfigError([f"kbit_upcast must be 'all', 'norms' or 'none', got {mode!r}"])
    if mode == "none":
        return []
    if mode == "all":
        candidates = list(model.named_parameters())
    else:
        candidates = [
            (f"{mod_name}.{p_name}" if mod_name else p_name, p)
            for mod_name, module in model.named_modules()
            if _is_norm_module(module)
            for p_name, p in module.named_parameters(recurse=False)
        ]
    cast = []
    for name, param in candidates:
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
            param.data = param.data.to(torch.float32)
            cast.append(name)
    return cast


def prepare_kbit_model(model: torch.nn.Module, upcast: str, checkpointing: bool) -> torch.nn.Module:
    """peft's k-bit preparation with the upcast chosen by ``kbit_upcast``.

    ``"all"`` is ``peft.prepare_model_for_kbit_training`` itself. It has no switch for its
    upcast, so for ``"norms"`` / ``"none"`` we take its steps ourselves: freeze every base
    parameter and upcast per :func:`upcast_for_kbit`; its remaining step, non-reentrant
    checkpointing (which needs no input-grad hook), is :func:`enable_checkpointing`, applied by
    the caller when ``checkpointing`` is set. Unverified on real k-bit models here (no CUDA).
    """
    if upcast == "all":
        from peft import prepare_model_for_kbit_training  # optional: LoRA runs only

        return prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    for param in model.parameters():
        param.requires_grad_(False)
    upcast_for_kbit(model, upcast)
    return model


def resolve_checkpointing(
    model: torch.nn.Module,
    config: TrainingConfig,
    accelerator: Accelerator | None,
    method: Any = None,
    dataset: Any = None,
) -> tuple[bool, str]:
    """``gradient_checkpointing`` for this run (``auto`` resolved by
    :func:`~grimoire.model.host_memory.checkpointing_decision` for ``method`` on ``dataset``'s rows),
    and why; logged."""
    device_type = accelerator.device.type if accelerator is not None else "cpu"
    # Processes sharing this host's memory (torchrun / accelerate set LOCAL_WORLD_SIZE).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or getattr(accelerator, "num_processes", 1)
    on, why = checkpointing_decision(
        model, config, device_type, local, method=method, dataset=dataset
    )
    logger.info("activation checkpointing: %s (%s)", "on" if on else "off", why)
    return on, why


__all__ = [
    "disable_dropout",
    "enable_checkpointing",
    "prepare_kbit_model",
    "resolve_checkpointing",
    "upcast_for_kbit",
]
