"""The policy's weights as a separate sampler (vLLM) loads them: checkpoint names, full tensors.

Stage: rollout (see docs/architecture.md). :func:`policy_weights` walks the TRAINING model's
parameters one at a time and yields ``(checkpoint name, full tensor)``, the format of a
``save_pretrained`` checkpoint, which is what vLLM's ``load_weights`` maps onto its own fused
layers. It never changes the training model and never holds more than one parameter (plus one
LoRA pair) in full at a time:

- FSDP2 (``DTensor`` shards): each parameter is gathered on its own (``full_tensor``, one
  all-gather of one tensor), handed on, and dropped, so no rank ever holds the whole model;
  every rank must walk the same parameters in the same order (every gather is a collective);
- LoRA (peft), merged (``merge_lora=True``; with ``False`` the base weights go as they are and
  :func:`write_adapter` saves the adapter for a sampler that applies it itself): adapter weights
  are not sent; each adapted layer's weight is sent MERGED,
  ``W + scaling * B @ A`` for the active adapters, computed on the side, so the trained base
  weights are never merged and unmerged in place (which would add rounding to them);
- wrappers' name parts (peft's ``base_model.model.`` and ``base_layer``, ``torch.compile``'s
  ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.``, peft's
  ``modules_to_save``) are dropped, so the names are those of the plain model's state dict.

:func:`weights_version` tells whether the weights changed since a sync: the number of optimizer
steps taken in this process (torch's global step hook: fused AdamW writes its parameters without
bumping their version counters) and the sum of the parameters' in-place version counters (a
checkpoint load, any other in-place write).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

#: Name parts wrappers add around a model's own parameter names.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "modules_to_save.default.")


#: Optimizer steps taken in this process (any optimizer), counted once the hook is installed.
_STEPS = [0]
_HOOK: list[Any] = []


def weights_version(model: torch.nn.Module) -> tuple[int, int]:
    """``(optimizer steps so far, sum of the parameters' version counters)``: grows whenever a
    weight may have been written, so an equal value means nothing was written since. The step
    hook is installed on the first call (steps before it are not counted; the first sync after
    it loads the weights anyway)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_count_step))
    return _STEPS[0], sum(int(p._version) for p in model.parameters())


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS[0] += 1


def policy_weights(model: torch.nn.Module, merge_lora: bool = True) -> Iterator[tuple[str, Tensor]]:
    """``(checkpoint name, full detached tensor)`` per parameter, LoRA merged (module
    docstring; ``merge_lora=False``: the base weights alone, for a sampler that applies the
    adapter itself). Lazy: FSDP2 gathers happen as the caller consumes the iterator."""
    lora = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    # Tied weights (an LM head sharing the embedding) are sent under every name: vLLM's in-place
    # reload re-creates each layer's parameters, which unties them, so the head must get its own.
    for name, param in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged below; a modules_to_save copy replaces its original
        owner, _, leaf = name.rpartition(".")
        tensor = _full(param.detach())
        layer = lora.get(owner.removesuffix(".base_layer"))
        if merge_lora and layer and owner.endswith(".base_layer") and leaf == "weight":
            # Merged in fp32, then cast once: a bf16 weight gets one rounding, not two.
            tensor = (tensor.float() + _lora_delta(layer)).to(tensor.dtype)
        yield checkpoint_name(name), tensor


def is_lora_policy(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries peft LoRA layers."""
    return any(_is_lora_layer(m) for m in model.modules())


def merged_bytes(model: torch.nn.Module) -> int:
    """Bytes :func:`policy_weights` sends (every weight in full, tied ones once per name),
    counted from the shapes without gathering or merging anything."""
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters(remove_duplicate=False)
        if ".lora_" not in name and ".original_module." not in name
    )


def lora_rank(model: torch.nn.Module) -> int:
    """The largest LoRA rank of the active adapter (``r`` and any ``rank_pattern`` entry)."""
    config = _adapter_config(model)
    return max([int(config.r), *(int(r) for r in (config.rank_pattern or {}).values())])


def write_adapter(model: torch.nn.Module, folder: Path) -> int:
    """The active adapter as ``save_pretrained`` writes it (``adapter_model.safetensors`` with
    peft's names, and ``adapter_config.json``), which is what vLLM loads a ``LoRARequest`` from;
    returns the tensors' bytes. Check :func:`adapter_problems` first."""
    from peft import get_peft_model_state_dict  # peft imports transformers: seconds

    config = _adapter_config(model)
    state = {k: _full(v.detach()).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "adapter_model.safetensors"))
    config.save_pretrained(str(folder))
    return sum(t.numel() * t.element_size() for t in state.values())


def adapter_problems(model: torch.nn.Module) -> list[str]:
    """Why the active adapter cannot reach vLLM alone: DoRA (vLLM serves plain LoRA only), or
    trainable weights outside the adapter (``modules_to_save``), which it would not carry."""
    config = _adapter_config(model)
    problems = []
    if getattr(config, "use_dora", False):
        problems.append(
            "engine.args.lora_sync: adapter: vLLM serves no DoRA adapters (and the merged sync "
            "merges plain LoRA only): train a plain LoRA (use_dora: false) with a vLLM engine"
        )
    if getattr(config, "modules_to_save", None):
        problems.append(
            "engine.args.lora_sync: adapter sends LoRA layers only, and this policy also trains "
            f"modules_to_save={sorted(config.modules_to_save)}: use lora_sync: merged"
        )
    return problems


def _adapter_config(model: torch.nn.Module) -> Any:
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise ValueError("not a peft model: no adapter to send")
    return configs[getattr(model, "active_adapter", "default")]


def checkpoint_name(name: str) -> str:
    """``name`` without the wrappers' parts: the plain model's state-dict name."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _full(t: Tensor) -> Tensor:
    """The whole tensor of an FSDP2 shard (one all-gather), or ``t`` itself."""
    full_tensor = getattr(t, "full_tensor", None)  # DTensor's: the one sharded type we meet
    return cast(Tensor, full_tensor()) if callable(full_tensor) else t


def _is_lora_layer(module: torch.nn.Module) -> bool:
    """A peft LoRA layer (``lora_A`` / ``lora_B`` / ``scaling`` around a ``base_layer``)."""
    return all(hasattr(module, a) for a in ("lora_A", "lora_B", "scaling", "base_layer"))


def _lora_delta(layer: Any) -> Tensor:
    """``sum over active adapters of scaling * B @ A`` (transposed for ``fan_in_fan_out``)."""
    delta: Tensor | int = 0
    if getattr(layer, "merged", False):
        return torch.zeros(())  # the adapters are already in the base weight
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(
                "VLLMEngine: DoRA adapters are not merged for the weight sync (only plain LoRA)"
            )
        a = _full(layer.lora_A[adapter].weight.detach())
        b = _full(layer.lora_B[adapter].weight.detach())
        if a.dim() != 2:
            raise NotImplementedError(
                f"VLLMEngine: LoRA on {type(layer.base_layer).__name__} layers is not merged for "
                "the weight sync (only Linear layers)"
            )
        d = (b.float() @ a.float()) * float(layer.scaling[adapter])
        delta = delta + (d.T if getattr(layer, "fan_in_fan_out", False) else d)
    return delta if isinstance(delta, Tensor) else torch.zeros(())


__all__ = [
    "adapter_problems",
    "checkpoint_name",
    "is_lora_policy",
    "lora_rank",
    "merged_bytes",
    "policy_weights",
    "weights_version",
    "write_adapter",
]
