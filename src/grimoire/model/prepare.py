"""Model and runtime set-up the trainer applies before training (kept out of the loop file)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.forward.reference import is_quantized
from grimoire.model.host_memory import checkpointing_decision

logger = logging.getLogger(__name__)


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


def count_tokens(batch: Mapping[str, Any]) -> float:
    """Real (non-pad) input tokens in a collated batch, over every ``*input_ids`` column."""
    total = 0.0
    for key, value in batch.items():
        if key.endswith("input_ids") and isinstance(value, torch.Tensor):
            mask = batch.get(key.replace("input_ids", "attention_mask"))
            total += float(mask.sum()) if isinstance(mask, torch.Tensor) else float(value.numel())
    return total


def resolve_mixed_precision(config: TrainingConfig) -> str:
    """The precision accelerate is asked for; fp16 needs CUDA (its loss scaler).

    ``"auto"`` is decided by the hardware (``precision.resolve_auto``: bf16 where the GPU or CPU
    has native bf16 matmuls, else fp32), and an explicit bf16 on a CPU without it warns.
    """
    from grimoire.model.precision import resolve_auto

    if config.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError(
            [
                "mixed_precision='fp16' needs a CUDA GPU; on CPU use 'auto', 'bf16' (fast with "
                "AMX or AVX512-BF16) or 'no'"
            ]
        )
    precision = resolve_auto(config.mixed_precision)
    if config.distributed == "fsdp2":
        return "no"  # FSDP2's MixedPrecisionPolicy casts the gathered weights instead of autocast
    return precision


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
        from peft import prepare_model_for_kbit_training

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


def prepare_model(
    model: torch.nn.Module,
    peft_config: Any,
    config: TrainingConfig,
    accelerator: Accelerator,
    packed: bool = False,
    checkpointing: bool | None = None,
) -> tuple[torch.nn.Module, list[Any]]:
    """Liger, LoRA (k-bit preparation for quantized bases), checkpointing, dropout, NEFTune, OSFT.

    ``checkpointing``: the run's resolved ``gradient_checkpointing`` (``None``: resolved here by
    :func:`resolve_checkpointing`). Returns the model to train and the optimizer-step hooks it
    needs (OSFT's projection).
    """
    quantized = is_quantized(model)
    if quantized and peft_config is None:
        raise ConfigError(["a quantized model can only be trained with LoRA: pass peft_config"])
    if config.osft and peft_config is not None:
        raise ConfigError(["OSFT and LoRA cannot be combined: drop peft_config or set osft=False"])
    if config.use_liger:
        from grimoire.model.liger import apply_liger

        apply_liger(model)
    if checkpointing is None:
        checkpointing = resolve_checkpointing(model, config, accelerator)[0]
    if peft_config is not None:
        from peft import get_peft_model

        if quantized:
            if config.kbit_gradient_checkpointing is not None:
                checkpointing = config.kbit_gradient_checkpointing
            model = prepare_kbit_model(model, config.kbit_upcast, checkpointing)
        model = get_peft_model(model, peft_config)
    if checkpointing:
        enable_checkpointing(model)
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if config.disable_dropout:
        disable_dropout(model)
    if packed:
        # Packed rows then attend per sample instead of through a dense L x L mask; exact, and
        # every other call (padded, generation, eval) stays transformers' sdpa.
        from grimoire.model.packed_attention import enable_packed_attention

        enable_packed_attention(model, torch_compile=config.torch_compile)
    if config.neftune_noise_alpha is not None:
        from grimoire.model.neftune import attach_neftune

        attach_neftune(model, config.neftune_noise_alpha)
    hooks: list[Any] = []
    if config.osft:
        from grimoire.model.osft import attach_osft

        hooks.append(attach_osft(model, config, accelerator))
    return model, hooks


def frozen_preparer(config: TrainingConfig, packed: bool) -> Any:
    """How a frozen model kept beside the policy (a reference) is prepared: the policy's packed
    attention, so both run the same kernels (policy == reference then gives exact ties, and the
    reference passes are as fast), and the policy's FSDP2 sharding."""

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        if packed:
            from grimoire.model.packed_attention import enable_packed_attention

            enable_packed_attention(model, torch_compile=config.torch_compile)
        if config.distributed == "fsdp2":
            from grimoire.parallel.fsdp import shard_model

            return shard_model(model, config)
        return model

    return prepare


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
    import copy
    from pathlib import Path

    from grimoire.parallel.fsdp import full_state_dict, is_sharded

    # Every rank takes part in gathering FSDP2 / ZeRO-3 shards; only the main process writes.
    if is_sharded(wrapped):
        state_dict = full_state_dict(wrapped)
    else:
        state_dict = accelerator.get_state_dict(wrapped)
    if not accelerator.is_main_process:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = accelerator.unwrap_model(wrapped)
    for hook in hooks:
        if hasattr(hook, "export_state_dict"):
            state_dict = hook.export_state_dict(state_dict)
    if merge_adapter and hasattr(model, "merge_and_unload"):
        copy.deepcopy(model).merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)


def check_world_size(num_processes: int) -> None:
    """Refuse to train alone when the launcher started several processes.

    accelerate's process state is a per-process singleton: if something built it before the
    trainer (e.g. ``PartialState()`` with its default ``cpu=False`` on a CPU-only machine), every
    torchrun worker would run the whole job by itself and they would overwrite each other's files.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE) but accelerate sees "
            f"{num_processes}; accelerate's process state was created before GrimoireTrainer "
            "with different settings. On a machine without a GPU create it as "
            "PartialState(cpu=True), or let GrimoireTrainer create it first."
        )
