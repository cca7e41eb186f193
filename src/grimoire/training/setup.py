"""The trainer's set-up, as named build steps run in order by ``GrimoireTrainer.__init__``.

Each step is one small function: what it needs comes in as arguments, what it builds goes out as
the return value, so ``__init__`` reads as the list of steps (accelerator, packing, model,
compile, budget, data checks, the method's context, collator, reference columns, loader,
sharding, optimizer and scheduler, ``accelerate.prepare``, callbacks). Model preparation
(:func:`prepare_model`) applies the pieces of :mod:`grimoire.model` in their one valid order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from grimoire.batching.budget import TokenBudget
from grimoire.batching.loader import StepLoader, packing_decision
from grimoire.batching.validation import validate_training_data
from grimoire.collate.buckets import WidthBuckets, bucket_multiple
from grimoire.config.context import TrainingContext
from grimoire.config.model_shape import shape_from_config
from grimoire.config.training import TrainingConfig
from grimoire.contract.method import GeneratingMethod, Method, generating
from grimoire.errors import ConfigError
from grimoire.forward.precomputed import precompute_reference
from grimoire.forward.reference import is_quantized
from grimoire.forward.sequence_split import sequence_group
from grimoire.model.host_allocator import return_freed_memory
from grimoire.model.liger import apply_liger
from grimoire.model.neftune import attach_neftune
from grimoire.model.osft import attach_osft
from grimoire.model.packed_attention import enable_packed_attention, unsupported_reason
from grimoire.model.precision import resolve_mixed_precision
from grimoire.model.prepare import (
    disable_dropout,
    enable_checkpointing,
    prepare_kbit_model,
    resolve_checkpointing,
)
from grimoire.model.ulysses_attention import enable_ulysses_attention
from grimoire.model.varlen_attention import cuda_route
from grimoire.optim.optimizers import build_optimizer, build_scheduler
from grimoire.parallel.accelerate import check_world_size, has_accelerator, reset_accelerate_state
from grimoire.parallel.deepspeed import (
    check_deepspeed,
    configure_deepspeed,
    partition_frozen,
    start_deepspeed_on_cpu,
    zero_stage,
)
from grimoire.parallel.fsdp import check_shard_group, is_sharded, shard_model
from grimoire.parallel.sequence import (
    check_sequence_parallel,
    data_parallel,
    start_sequence_parallel,
)
from grimoire.rollout.async_rollouts import AsyncRolloutStage, async_problems
from grimoire.rollout.stage import ReferenceLogps, RolloutStage
from grimoire.training.callbacks import CallbackList, ProgressCallback, TrainerCallback
from grimoire.training.phases import phase

logger = logging.getLogger(__name__)


def check_config(config: Any) -> TrainingConfig:
    """Refuse anything but a :class:`TrainingConfig` (a dict or a CLI namespace would fail late)."""
    if not isinstance(config, TrainingConfig):
        raise ConfigError([f"config must be a TrainingConfig, got {type(config).__name__}"])
    return config


def build_accelerator(config: TrainingConfig) -> Accelerator:
    """A fresh per-run accelerate state (device, precision, trackers), checked against the
    launcher's world size and the FSDP2 shard group size; then the run's seed."""
    reset_accelerate_state()
    accelerator = Accelerator(
        # On a machine with no accelerator, torchrun/accelerate-launched processes must be told
        # to form a CPU (gloo) group; otherwise each would silently train alone. DeepSpeed forms
        # that group itself first (accelerate turns DeepSpeed off for cpu=True).
        cpu=not has_accelerator() and not start_deepspeed_on_cpu(),
        mixed_precision=resolve_mixed_precision(config),
        # accelerate types log_with as an invariant list[str | LoggerType | GeneralTracker],
        # so a list[str] (which it accepts) does not match.
        log_with=config.log_with,  # pyright: ignore[reportArgumentType]
        project_dir=config.output_dir,
    )
    if config.return_freed_memory:
        return_freed_memory()
    check_world_size(accelerator.num_processes)
    check_shard_group(config.fsdp_shard_group_size, accelerator.num_processes)
    check_sequence_parallel(config.sequence_parallel_size, accelerator.num_processes)
    check_deepspeed(accelerator, config)
    set_seed(config.seed)
    return accelerator


def decide_packing(
    method: Method,
    config: TrainingConfig,
    pad_id: int,
    data_collator: Any,
    model: torch.nn.Module,
    dataset: Any,
    accelerator: Accelerator,
) -> bool:
    """Whether micro-batches are packed rows (``padding_free``: auto / forced); the reason is
    logged. On CUDA, auto packs only where packed rows would take a varlen kernel."""
    device_type = accelerator.device.type
    varlen = cuda_varlen(model, config, accelerator) if device_type == "cuda" else None
    packed, why = packing_decision(
        method, config, pad_id, data_collator, model, dataset, device_type, varlen
    )
    logger.info("micro-batches: %s (%s)", "packed rows" if packed else "padded", why)
    return packed


def cuda_varlen(model: torch.nn.Module, config: TrainingConfig, accelerator: Accelerator) -> str:
    """Why packed rows would (``"varlen: ..."``) or would not take one varlen kernel call per
    layer on this CUDA device, for ``padding_free`` auto: grimoire's attention must serve the
    model and the kernel take its head size, dtype (the run's autocast) and dropout."""
    reason = unsupported_reason(model, config.torch_compile)
    if reason is not None:
        return f"no varlen kernel: {reason}"
    cfg = model.config
    head_dim = shape_from_config(cfg).head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        str(accelerator.mixed_precision), next(model.parameters()).dtype
    )
    route, why = cuda_route(dtype, head_dim, float(getattr(cfg, "attention_dropout", 0.0) or 0))
    return f"{route}: {why}" if route != "per_sample" else f"no varlen kernel: {why}"


def prepare_model(
    model: torch.nn.Module,
    peft_config: Any,
    config: TrainingConfig,
    accelerator: Accelerator | None,
    packed: bool = False,
    checkpointing: bool | None = None,
) -> tuple[torch.nn.Module, list[Any]]:
    """Liger, LoRA (k-bit preparation for quantized bases), checkpointing, dropout, packed
    attention, NEFTune, OSFT, in that order.

    ``checkpointing``: the run's resolved ``gradient_checkpointing`` (``None``: resolved here by
    :func:`~grimoire.model.prepare.resolve_checkpointing`). Returns the model to train and the
    optimizer-step hooks it needs (OSFT's projection).
    """
    quantized = is_quantized(model)
    if quantized and peft_config is None:
        raise ConfigError(["a quantized model can only be trained with LoRA: pass peft_config"])
    if config.osft and peft_config is not None:
        raise ConfigError(["OSFT and LoRA cannot be combined: drop peft_config or set osft=False"])
    if config.use_liger:
        apply_liger(model)
    if checkpointing is None:
        checkpointing = resolve_checkpointing(model, config, accelerator)[0]
    if peft_config is not None:
        from peft import get_peft_model  # lazy like every peft use: only LoRA runs pay its import

        if quantized:
            if config.kbit_gradient_checkpointing is not None:
                checkpointing = config.kbit_gradient_checkpointing
            model = prepare_kbit_model(model, config.kbit_upcast, checkpointing)
        model = get_peft_model(model, peft_config)
    if checkpointing:
        enable_checkpointing(model)
    hf_config: Any = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "use_cache"):
        hf_config.use_cache = False
    if config.disable_dropout:
        disable_dropout(model)
    if config.sequence_parallel_size > 1:  # the packed attention over a row split across ranks
        enable_ulysses_attention(model, config.sequence_parallel_size)
    elif packed or _on_cuda(accelerator):
        # grimoire's attention where it is exact: packed rows attend within their samples (one
        # varlen call per layer on CUDA, per-sample sdpa elsewhere) instead of through a dense
        # L x L mask; on CUDA also right-padded rows, causally without a mask. The forward hands
        # it the collator's host-side lengths, so no mask is built or read back (a host sync
        # per forward on a GPU). Every other call is transformers' sdpa.
        enable_packed_attention(model, torch_compile=config.torch_compile)
    if config.neftune_noise_alpha is not None:
        attach_neftune(model, config.neftune_noise_alpha)
    hooks: list[Any] = []
    if config.osft:
        hooks.append(attach_osft(model, config, accelerator))
    return model, hooks


def sequence_parallel(config: TrainingConfig, method: Method, packed: bool) -> None:
    """Refuse what the sequence split does not serve, then build its mesh (size > 1 only)."""
    start_sequence_parallel(config.sequence_parallel_size, method, packed)


def _on_cuda(accelerator: Accelerator | None) -> bool:
    return accelerator is not None and accelerator.device.type == "cuda"


def frozen_preparer(config: TrainingConfig, packed: bool, accelerator: Accelerator) -> Any:
    """How a frozen model kept beside the policy (a reference) is prepared: the policy's
    attention (:func:`prepare_model`), so both run the same kernels (policy == reference then
    gives exact ties, and the reference passes are as fast), and the policy's FSDP2 sharding or
    ZeRO-3 partitioning."""
    on_cuda = _on_cuda(accelerator)

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        if config.sequence_parallel_size > 1:
            enable_ulysses_attention(model, config.sequence_parallel_size)
        elif packed or on_cuda:
            enable_packed_attention(model, torch_compile=config.torch_compile)
        if config.distributed == "fsdp2":
            return shard_model(model, config)
        return partition_frozen(model, accelerator)  # as it is unless under ZeRO-3

    return prepare


def build_budget(config: TrainingConfig, method: Method, packed: bool) -> TokenBudget | None:
    """The per-device token budget (``max_tokens_per_device``), or None for fixed-size batches;
    under sequence parallelism a row holds ``sequence_parallel_size`` times it."""
    if not config.max_tokens_per_device:
        return None
    budget, truncate = config.max_tokens_per_device, config.truncate_long_samples
    return TokenBudget(budget, method, packed, truncate, config.sequence_parallel_size)


def validate_data(
    method: Method,
    model: torch.nn.Module,
    config: TrainingConfig,
    budget: TokenBudget | None,
    train_dataset: Any,
    eval_dataset: Any,
) -> None:
    """Every problem with the tokenized datasets (columns, lengths, token ids beyond the
    vocabulary, rows over the budget), raised together before anything trains."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    validate_training_data(
        method,
        {"train": train_dataset, "eval": eval_dataset},
        config.max_length,
        getattr(embeddings, "num_embeddings", None),
        budget,
    )


def setup_method(
    method: Method,
    config: TrainingConfig,
    accelerator: Accelerator,
    tokenizer: Any,
    model: torch.nn.Module,
    datasets: tuple[Any, Any],
    packed: bool,
) -> TrainingContext:
    """The method's view of the run, handed to its ``setup`` hook.

    Runs before the method's collator exists (KTO bounds its KL rows by ``max_length``) and
    before DDP wraps the policy (the context holds the unwrapped model).
    """
    context = TrainingContext(config, accelerator, tokenizer, model, *datasets, packed=packed)
    sp = sequence_group()
    context.sum_group = None if sp is None else sp.data  # each sequence group counted once
    context.prepare_frozen = frozen_preparer(config, packed, accelerator)
    method.setup(context)
    return context


def build_collator(
    method: Method,
    data_collator: Any,
    packed: bool,
    pad_id: int,
    config: TrainingConfig | None = None,
    device_type: str = "cpu",
) -> Any:
    """The user's collator, else the method's packed or padded one; padded batches' widths
    rounded up to ``pad_to_multiple_of`` (64 on CUDA by default: few shapes, no per-shape cost;
    :mod:`grimoire.collate.buckets`), within the token budget."""
    if data_collator is not None:
        return data_collator
    if packed:
        return method.create_packed_collator(pad_id)
    collator = method.create_collator(pad_id)
    multiple = bucket_multiple(config.pad_to_multiple_of if config else None, device_type)
    if multiple > 1:
        budget = config.max_tokens_per_device if config else None
        collator = WidthBuckets(collator, multiple, pad_id, budget)
    return collator


def precompute_reference_columns(
    method: Method,
    model: torch.nn.Module,
    context: TrainingContext,
    collator: Any,
    budget: TokenBudget | None,
) -> tuple[Any, Any]:
    """``precompute_ref_log_probs``: one no-grad reference pass now, batched as training will
    be; the reference is then released and training reads the datasets' cached columns (they
    replace the context's datasets). Returns the (train, eval) datasets training reads."""
    config = context.config
    if not config.precompute_ref_log_probs:
        return context.train_dataset, context.eval_dataset
    context.train_dataset, context.eval_dataset = precompute_reference(
        method,
        model,
        (context.train_dataset, context.eval_dataset),
        collator=collator,
        budget=budget,
        batch_size=config.effective_eval_batch_size,
        accelerator=context.accelerator,
        move_policy=config.distributed != "fsdp2",
        # Minutes on a real model before the first step: said as it goes (training/phases.py).
        progress=lambda split, rows: phase(f"reference log-probs of the {split} rows", rows),
    )
    return context.train_dataset, context.eval_dataset


def build_rollouts(method: Method, context: TrainingContext) -> RolloutStage | None:
    """The rollout stage of a method that generates, owned by the trainer: built from the parts
    it declares as a :class:`~grimoire.contract.method.GeneratingMethod` (engine, reward
    functions, sampling, ``build_batches``, the reference log-probs when it has a reference)
    and bound to the run's policy. None for other methods."""
    online = generating(method)
    if online is None:
        return None
    if zero_stage(context.accelerator) == 3:
        # Every forward of a ZeRO-3 policy is a collective and sampling lengths differ by rank;
        # keeping ranks in step (as under FSDP2) has not been run under DeepSpeed.
        raise ConfigError(
            [f"{method.method_name} generates: not supported under DeepSpeed ZeRO-3 (use FSDP2)"]
        )
    staleness = online.max_staleness
    problems = async_problems(
        "loss.args.max_staleness",
        staleness,
        online.engine,
        context.sharded,
        context.num_processes,
        online.agent is not None,
    )
    if problems:
        raise ConfigError(problems)
    async_args = {"max_staleness": staleness} if staleness > 0 else {}
    stage = (AsyncRolloutStage if staleness > 0 else RolloutStage)(
        online.engine,
        online.reward_funcs,
        online.sampling,
        online.build_batches,
        steps_per_batch=online.steps_per_batch,
        needs_old_logps=online.needs_old_logps,
        reference_logps=_completion_reference(online, context),
        agent=online.agent,
        **async_args,
    )
    stage.bind(context)
    return stage


def _completion_reference(
    online: GeneratingMethod[Any, Any, Any, Any], context: TrainingContext
) -> ReferenceLogps | None:
    """What the rollout stage scores each group's completions with when the method has a
    reference: its ``reference_logps`` on the run's policy (``[N, C]``); else None."""
    if not online.needs_reference_model:
        return None
    return lambda batch: online.reference_logps(context.unwrapped_model, batch)[0]


def log_reference(method: Method) -> None:
    """Say where a method's reference log-probs come from (cache, adapters, a frozen copy)."""
    if method.needs_reference_model:
        reference = method.reference
        source = reference.source if reference is not None else "the method's own"
        logger.info("%s: reference log-probs from %s", method.method_name, source)


def build_loader(
    dataset: Any,
    collator: Any,
    budget: TokenBudget | None,
    accelerator: Accelerator,
    batch_size: int,
    sequence_parallel_size: int = 1,
    **kwargs: Any,
) -> StepLoader:
    """This rank's step loader over ``dataset`` (planned once; see :class:`StepLoader`); the
    ranks of a sequence group read the same micro-batches."""
    world, rank = data_parallel(
        sequence_parallel_size, accelerator.num_processes, accelerator.process_index
    )
    return StepLoader.build(
        dataset, collator, budget, batch_size=batch_size, world_size=world, rank=rank, **kwargs
    )


def shard(model: torch.nn.Module, config: TrainingConfig) -> torch.nn.Module:
    """FSDP2 sharding (``distributed="fsdp2"``), before the optimizer exists so its state is
    sharded too; accelerate never wraps a sharded model (on CPU its FSDP plugin would silently
    run DDP)."""
    return shard_model(model, config) if config.distributed == "fsdp2" else model


def build_optimization(
    model: torch.nn.Module, config: TrainingConfig, accelerator: Accelerator, max_steps: int
) -> tuple[torch.nn.Module, Any, Any]:
    """Optimizer and schedule, then ``accelerate.prepare`` (DDP / DeepSpeed wrapping; a sharded
    model stays as it is). Returns ``(model, optimizer, scheduler)``."""
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, max_steps)
    configure_deepspeed(accelerator, config)
    if is_sharded(model):
        return model, accelerator.prepare(optimizer), scheduler
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


def build_callbacks(
    callbacks: Sequence[TrainerCallback] | None, config: TrainingConfig
) -> CallbackList:
    """The user's callbacks, then the progress bar (last, so its eval line shows metrics other
    callbacks add)."""
    return CallbackList(
        list(callbacks or []) + ([ProgressCallback()] if config.progress_bar else [])
    )


__all__ = [
    "build_accelerator",
    "build_budget",
    "build_callbacks",
    "build_collator",
    "build_loader",
    "build_optimization",
    "check_config",
    "cuda_varlen",
    "decide_packing",
    "frozen_preparer",
    "log_reference",
    "precompute_reference_columns",
    "prepare_model",
    "setup_method",
    "shard",
    "validate_data",
]
