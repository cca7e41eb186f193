"""A ``grimoire train`` YAML config read as the settings that decide memory (:class:`Setup`).

The same sections ``grimoire train`` reads, read the same way (``grimoire.config.loading``'s
loader, ``TrainingConfig`` for ``training:``, the loss registry for ``loss:``, ``LoraConfig``'s
field names for ``peft:``), minus everything memory does not depend on: the datasets are not
opened and the model is sized from its ``config.json`` alone. ``auto`` settings are resolved as
they would be on a CUDA GPU with bf16 (``mixed_precision`` -> bf16, ``gradient_checkpointing`` ->
on), the machines the estimate is for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from grimoire.columns import sequence_prefixes
from grimoire.compat.trl_names import trl_hint
from grimoire.config import registry
from grimoire.config.model_shape import ModelShape, dtype_name
from grimoire.config.training import TrainingConfig
from grimoire.contract.method import Method, generating
from grimoire.errors import ConfigError
from grimoire.losses.adapter import as_method
from grimoire.tools.memory.estimate import Rollout, Setup
from grimoire.tools.memory.shape import load_shape, lora_from_section

#: ``loss.ref_model`` value for a frozen copy of the starting policy (as in the CLI schema).
REF_MODEL_COPY = "copy"


@dataclass(frozen=True)
class RunPlan:
    """What a run config says about memory: the model's shape, the settings, and how the
    micro-batch size was found."""

    shape: ModelShape
    setup: Setup
    tokens_from: str
    method: str


def _section(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError([f"{key}: expected a mapping, got {type(value).__name__} {value!r}"])
    return dict(value)


def _model_source(model: dict[str, Any]) -> tuple[str, str, bool]:
    """``(pretrained, dtype, trust_remote_code)`` of the ``model:`` section (earlier spellings
    ``name_or_path``, ``dtype``, ``trust_remote_code`` accepted as ``grimoire train`` does)."""
    source = model.get("pretrained") or model.get("name_or_path")
    if not isinstance(source, str) or not source:
        raise ConfigError(
            ["model.pretrained: required (a hub name, a local folder, or tiny:llama)"]
        )
    kwargs = dict(model.get("model_kwargs") or {})
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", model.get("dtype", "auto")))
    trust = bool(kwargs.get("trust_remote_code", model.get("trust_remote_code", False)))
    return source, str(dtype), trust


def _loss(raw: Mapping[str, Any]) -> tuple[str, Method]:
    loss = _section(raw, "loss") or {"type": "sft"}
    if "type" not in loss:
        raise ConfigError(["loss.type: required (e.g. sft, or package.module:MyLoss)"])
    cls = registry.resolve(loss["type"], registry.LOSSES, "loss.type")
    args = dict(loss.get("args") or {})
    args.pop("ref_model", None)  # loaded by the CLI, never built here
    try:
        return loss["type"], as_method(cls(**args))
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"loss: {loss['type']}: {exc}"]) from exc


def _reference(raw: Mapping[str, Any], method: Method, config: TrainingConfig, lora: bool) -> str:
    """Where the reference log-probs come from during training (what stays in memory)."""
    if not method.needs_reference_model:
        return "none"
    loss = _section(raw, "loss")
    if loss.get("cache_reference") or config.precompute_ref_log_probs:
        return "cached"  # scored once before training; no second model while training
    if loss.get("ref_model"):
        return "model"
    return "adapters" if lora else "model"


def _tokens(method: Method, config: TrainingConfig) -> tuple[int, str]:
    """Positions in the largest forward pass of a micro-batch (the whole row, before a
    sequence-parallel split), and where that came from."""
    if config.max_tokens_per_device:
        n = config.sequence_parallel_size
        if n > 1:  # the budget is per device: a row split over N devices holds N times it
            return n * config.max_tokens_per_device, (
                f"training.max_tokens_per_device {config.max_tokens_per_device} per device x "
                f"sequence_parallel_size {n}"
            )
        return config.max_tokens_per_device, "training.max_tokens_per_device"
    prefixes = sequence_prefixes(method.required_columns) or [""]
    per_row = method.budget_tokens(dict.fromkeys(prefixes, config.max_length), False)
    return (
        config.batch_size * int(per_row),
        f"batch_size {config.batch_size} x {per_row} (every sequence at max_length "
        f"{config.max_length})",
    )


def _rollout(method: Method, tokens: int, config: TrainingConfig) -> Rollout | None:
    online = generating(method)
    if online is None:
        return None
    sampling = online.sampling
    length = config.max_length + sampling.max_new_tokens
    sequences = max(sampling.num_generations, tokens // length)
    if sampling.generation_batch_size:
        sequences = min(sequences, sampling.generation_batch_size)
    return Rollout(sequences=sequences, length=length)


def plan_from_config(
    raw: Mapping[str, Any],
    world_size: int = 1,
    shard_group: int | None = None,
    model: str | None = None,
) -> RunPlan:
    """The :class:`RunPlan` of a raw run config (``grimoire train``'s YAML) for ``world_size``
    ranks; ``shard_group`` for HSDP; ``model`` replaces ``model.pretrained`` (e.g. a
    ``config.json`` path)."""
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the config must be a mapping, got {type(raw).__name__}"])
    training = _section(raw, "training")
    config = TrainingConfig.from_dict(training, hint=trl_hint)
    section = _section(raw, "model")
    if model:
        section["pretrained"] = model
    source, dtype, trust = _model_source(section)
    shape = load_shape(source, trust_remote_code=trust)
    method_name, method = _loss(raw)
    lora = lora_from_section(raw.get("peft"))
    if lora is not None and config.disable_dropout:
        lora = replace(lora, dropout=0.0)  # disable_dropout zeroes LoRA's dropout too
    quant = _section(raw, "quantization")
    bits = 4 if quant.get("load_in_4bit") else 8 if quant.get("load_in_8bit") else None
    if bits and lora is None:
        raise ConfigError(["quantization: a quantized base trains only with a peft: section"])
    tokens, tokens_from = _tokens(method, config)
    precision = "bf16" if config.mixed_precision == "auto" else config.mixed_precision
    checkpointing = config.gradient_checkpointing
    group = shard_group or config.fsdp_shard_group_size  # --shard-group-size overrides it
    setup = Setup(
        world_size=world_size,
        shard_group=group,
        distributed=config.distributed,
        cpu_offload=config.fsdp_cpu_offload,
        reshard_after_forward=config.fsdp_reshard_after_forward,
        weight_dtype=shape.dtype if dtype == "auto" else dtype_name(dtype),
        mixed_precision=precision,
        optimizer=config.optimizer,
        checkpointing=True if checkpointing == "auto" else bool(checkpointing),
        tokens=tokens,
        grad_accum=config.gradient_accumulation_steps,
        fused=method.fused,
        chunk_rows=method.fused_chunk_size,
        lora=lora,
        quant_bits=bits,
        reference=_reference(raw, method, config, lora is not None),
        rollout=_rollout(method, tokens, config),
        score_head=method.model_kind == "sequence_classification",
        sequence_parallel=config.sequence_parallel_size,
    )
    problems = check_setup(setup)
    if problems:
        raise ConfigError(problems, title="cannot estimate this setup")
    return RunPlan(shape, setup, tokens_from, method_name)


def check_setup(setup: Setup) -> list[str]:
    """Settings the run itself would refuse, or the estimate cannot describe."""
    p = []
    if setup.world_size < 1:
        p.append(f"--world-size must be >= 1, got {setup.world_size}")
    group = setup.shard_group
    if group is not None:
        if not setup.sharded:
            p.append("a shard group (HSDP) needs training.distributed: fsdp2")
        elif group < 1 or setup.world_size % group:
            p.append(
                f"the shard group size ({group}) must divide the world size ({setup.world_size})"
            )
    n = setup.sequence_parallel
    if n > 1 and setup.world_size % n:
        p.append(
            f"training.sequence_parallel_size={n} does not divide --world-size "
            f"{setup.world_size}: give the run's number of processes (a multiple of {n})"
        )
    if setup.cpu_offload and not setup.sharded:
        p.append("training.fsdp_cpu_offload needs training.distributed: fsdp2")
    if setup.sharded and setup.mixed_precision == "fp16":
        p.append("distributed=fsdp2 runs bf16 or fp32: set mixed_precision to bf16 or no")
    return p


__all__ = ["REF_MODEL_COPY", "RunPlan", "check_setup", "plan_from_config"]
