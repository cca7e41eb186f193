"""DeepSpeed ZeRO through accelerate: start-up on CPU, the engine's settings, the frozen reference
under ZeRO-3, and the engine's own checkpoints.

accelerate wraps the policy in a DeepSpeed engine when the launcher asks for it (``accelerate
launch`` with a DeepSpeed config). Grimoire's loop stays the same with these differences:

- the engine steps the optimizer inside the step's last ``backward`` (accelerate's wrapper), so
  the trainer sums the loss units over ranks before the backward passes instead of rescaling the
  gradients after them, and DeepSpeed clips (``gradient_clipping`` := ``max_grad_norm``);
- a frozen model beside the policy (a reference) is partitioned the same way under ZeRO-3 (an
  engine without an optimizer, whose forward gathers its weights) and stays a plain replicated
  module under ZeRO-1/2, where the policy's weights are replicated too;
- checkpoints are the engine's own (``save_checkpoint`` / ``load_checkpoint``: each rank's ZeRO
  partitions, fp32 master weights and optimizer state), resumed on the same number of processes.

``deepspeed`` itself is imported only by runs that use it (the ``deepspeed`` extra).
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.parallel.accelerate import has_accelerator

logger = logging.getLogger(__name__)

#: Sub-folder of a checkpoint holding the DeepSpeed engine's state (``engine.save_checkpoint``).
ENGINE_DIR = "deepspeed"


def wants_deepspeed() -> bool:
    """Whether the launcher asked for DeepSpeed (``accelerate launch`` with a DeepSpeed config
    exports ``ACCELERATE_USE_DEEPSPEED=true``)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def start_deepspeed_on_cpu() -> bool:
    """On a machine without an accelerator, start DeepSpeed's process group on gloo; True if so.

    accelerate only selects DeepSpeed for ``Accelerator(cpu=False)``, and with ``cpu=False`` on a
    CPU-only machine it finds no backend and silently runs a single process. So the group is
    formed here first (DeepSpeed's CPU accelerator, gloo) and accelerate's per-process state is
    built as a multi-process CPU state (``cpu=True``); the trainer's ``Accelerator(cpu=False)``
    then reuses that state and turns on the DeepSpeed plugin.
    """
    if not wants_deepspeed() or has_accelerator() or int(os.environ.get("LOCAL_RANK", -1)) < 0:
        return False
    import deepspeed  # optional (the `deepspeed` extra): only DeepSpeed runs import it
    import deepspeed.comm.torch

    # On CPU DeepSpeed JIT-compiles a shared-memory all-reduce (C++, with ninja) as its process
    # group starts: minutes on a fresh machine, a compiler required, and only its tensor-parallel
    # inference uses it (inference_all_reduce). Training's collectives are torch.distributed's.
    deepspeed.comm.torch.build_shm_op = lambda: None
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        atexit.register(release_at_exit)
    PartialState(cpu=True)
    return True


def release_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole (an atexit hook).

    Without it ZeRO-3 runs can abort after training ("terminate called without an active
    exception", SIGABRT): gloo's worker threads can still be releasing the last asynchronous
    all-gather (ZeRO-3 fetches parameters with them) during interpreter finalization; dropping its
    tensors takes the GIL, a finalizing interpreter ends such a thread with ``pthread_exit``, and
    the unwind through the C++ destructor calls ``std::terminate``. ``destroy_process_group``
    shuts the groups down and drains their work first. A no-op after ``GrimoireTrainer.close()``.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def uses_deepspeed(accelerator: Accelerator) -> bool:
    """Whether accelerate runs the model through a DeepSpeed engine."""
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def zero_stage(accelerator: Accelerator) -> int | None:
    """The run's ZeRO stage (0-3), or None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def check_deepspeed(accelerator: Accelerator, config: TrainingConfig) -> None:
    """Refuse the settings that cannot work with a DeepSpeed engine, before anything is built."""
    if not uses_deepspeed(accelerator):
        return
    problems = []
    if config.distributed == "fsdp2":
        problems.append(
            "distributed='fsdp2' under a DeepSpeed launch: pick one (ZeRO-3 already shards)"
        )
    if config.osft:
        # OSFT projects the gradients between the backward passes and the optimizer step;
        # DeepSpeed's engine steps inside the last backward, so there is no such point.
        problems.append("osft=True does not run under DeepSpeed: launch with DDP or FSDP2")
    if config.sequence_parallel_size > 1:
        problems.append(
            "training.sequence_parallel_size > 1 does not run under DeepSpeed yet: launch with DDP"
        )
    if problems:
        raise ConfigError(problems)


def configure_deepspeed(accelerator: Accelerator, config: TrainingConfig) -> None:
    """Fill the DeepSpeed config from the :class:`TrainingConfig` before the engine is built.

    - ``train_micro_batch_size_per_gpu``: DeepSpeed sizes its engine from a DataLoader we do not
      give accelerate; ``batch_size`` when left ``"auto"``.
    - ``gradient_accumulation_steps`` = 1: our loop accumulates micro-batches itself (one engine
      step per optimizer step; accelerate marks the last backward as the boundary).
    - ``gradient_clipping`` = ``max_grad_norm`` (0: none): the engine clips, inside its step.
    - ZeRO-3: ``stage3_gather_16bit_weights_on_model_save`` on, so that ``save_model`` and every
      checkpoint can gather the full weights for the ``from_pretrained`` export.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = config.batch_size
    ds["gradient_accumulation_steps"] = 1
    ds.pop("train_batch_size", None)
    clip = float(config.max_grad_norm or 0.0)
    if ds.get("gradient_clipping", "auto") not in ("auto", clip):
        logger.warning(
            "DeepSpeed gradient_clipping=%s replaced by TrainingConfig.max_grad_norm=%s",
            ds["gradient_clipping"],
            config.max_grad_norm,
        )
    ds["gradient_clipping"] = clip
    zero = ds.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True


def partition_frozen(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """A frozen model (a reference) partitioned like a ZeRO-3 policy: an engine without an
    optimizer, whose forward gathers each layer's weights and frees them after. Under ZeRO-0/1/2
    the policy's weights are replicated, and so the frozen model stays as it is."""
    if zero_stage(accelerator) != 3:
        return model
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    assert plugin is not None, "zero_stage found the DeepSpeed plugin"
    ds = plugin.deepspeed_config
    zero = ds.get("zero_optimization", {})
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # unused: no optimizer, no data loader
        "zero_optimization": {
            "stage": 3,
            # Offloading the frozen weights follows the policy's parameter offload.
            "offload_param": zero.get("offload_param", {"device": "none"}),
        },
    }
    for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        if isinstance(zero.get(key), int | float):  # "auto" is resolved for the policy only
            config["zero_optimization"][key] = zero[key]
    for precision in ("bf16", "fp16"):  # the policy's weights precision (set by accelerate)
        if ds.get(precision, {}).get("enabled") is True:
            config[precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed engine (found by name: deepspeed may be absent)."""
    return any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__)


def save_engine(folder: Path, engine: Any) -> None:
    """The engine's state into ``folder/deepspeed``: every rank writes its ZeRO partitions (fp32
    master weights, optimizer state) and rank 0 the module's weights."""
    engine.save_checkpoint(str(folder), tag=ENGINE_DIR, save_latest=False)


def load_engine(folder: Path, engine: Any) -> None:
    """Restore ``folder/deepspeed`` into ``engine`` (the same number of processes: ZeRO's
    partitions are per rank). The learning-rate schedule is Grimoire's own (``scheduler.pt``)."""
    if not (folder / ENGINE_DIR).is_dir():
        raise FileNotFoundError(
            f"{folder} has no {ENGINE_DIR}/ folder: it was not written under DeepSpeed; resume "
            "it the way it was launched, or start from its weights (model.safetensors)"
        )
    path, _ = engine.load_checkpoint(
        str(folder), tag=ENGINE_DIR, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the engine state in {folder / ENGINE_DIR}")


__all__ = [
    "ENGINE_DIR",
    "check_deepspeed",
    "configure_deepspeed",
    "is_engine",
    "load_engine",
    "partition_frozen",
    "release_at_exit",
    "save_engine",
    "start_deepspeed_on_cpu",
    "uses_deepspeed",
    "wants_deepspeed",
    "zero_stage",
]
