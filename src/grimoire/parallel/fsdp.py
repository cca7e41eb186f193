"""Sharding on torch's own engine: FSDP2 (``fully_shard``) and distributed checkpoints (DCP).

``TrainingConfig.distributed="fsdp2"`` shards every decoder layer, then the root module, with
``torch.distributed.fsdp.fully_shard``: each process holds ``1/N`` of every parameter, gradient
and optimizer state (DTensors), gathers a layer's weights just for its forward / backward and
frees them after (``fsdp_reshard_after_forward``). The same code runs on CPU (gloo, what CI tests)
and GPU (NCCL). accelerate still provides the process group, device and logging, but never wraps
the model: on CPU an accelerate FSDP plugin silently falls back to plain DDP.

``fsdp_shard_group_size=k`` makes it hybrid (HSDP): torch's 2-D device mesh ``(N / k, k)``, each
parameter sharded over ``k`` consecutive processes (a node) and replicated across the groups.

Checkpoints use ``torch.distributed.checkpoint`` (DCP) for every run, sharded or not: each process
writes its shards, and a checkpoint loads into any number of processes (DCP reshards). The
``from_pretrained`` export gathers the full weights on the main process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from grimoire.errors import ConfigError
from grimoire.forward.sequence_split import set_sequence_group
from grimoire.model.blocks import block_modules
from grimoire.model.precision import decide

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

#: Sub-folder of a checkpoint holding the DCP shards of the model and optimizer.
DCP_DIR = "dcp"


def ensure_process_group() -> None:
    """FSDP2 needs a process group, also for one process: start a 1-rank gloo group then."""
    if dist.is_available() and not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return False
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """``fully_shard`` each transformer block, then the root (in place; returns ``model``).

    bf16 mixed precision becomes FSDP2's own policy (parameters gathered in bf16, gradients
    reduced in fp32), replacing autocast; ``fsdp_cpu_offload`` keeps the shards and optimizer
    state in CPU memory. The LM head stays in the root unit, with the input embedding it may be
    tied to: the fused log-prob path gathers that unit around its chunk loop
    (:mod:`grimoire.forward.head.sharded`); a head sharded as its own unit would be gathered by
    FSDP's hooks once per chunk, so the fused path falls back for it.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if config.fsdp_cpu_offload and not torch.cuda.is_available():
        raise ConfigError(
            [
                "fsdp_cpu_offload=True moves shards from an accelerator to CPU memory; with no "
                "GPU everything is already in CPU memory: set it to false"
            ]
        )
    ensure_process_group()
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if decide(config.mixed_precision)[0] == "bf16"  # "auto" resolved for this hardware
        else MixedPrecisionPolicy()
    )
    kwargs = {
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy() if config.fsdp_cpu_offload else OffloadPolicy(),
        "reshard_after_forward": config.fsdp_reshard_after_forward,
        "mesh": shard_mesh(config),  # None: fully_shard's default 1-D mesh over every process
    }
    for block in block_modules(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


#: Dimension names of the hybrid-sharding mesh, in torch's HSDP order: dim 0 replicates across
#: shard groups, dim 1 shards within one (``fully_shard`` reads a 2-D mesh this way).
MESH_DIMS = ("replicate", "shard")
# One mesh per (world group, group size, device): the policy and a frozen reference model shard
# over the same process groups instead of each creating its own (every new group costs
# connections). The world group object is kept so a cached mesh never outlives its group.
_MESHES: dict[tuple[int, str], tuple[Any, Any]] = {}


def check_shard_group(group_size: int | None, world_size: int) -> None:
    """Refuse a shard group size that does not divide the world size (a ragged mesh cannot be
    built); called at start-up, before the model is prepared."""
    if group_size is not None and world_size % group_size:
        raise ConfigError(
            [
                f"training.fsdp_shard_group_size={group_size} does not divide the {world_size} "
                f"processes of this run: set it to a divisor of {world_size}, usually the "
                "processes per node (torchrun --nproc-per-node), or null to shard over every "
                "process"
            ]
        )


def shard_mesh(config: Any) -> Any:
    """The ``DeviceMesh`` FSDP2 shards on: ``None`` (``fully_shard``'s own 1-D mesh over every
    process) unless ``fsdp_shard_group_size`` is set, then torch's 2-D HSDP mesh
    ``(world // k, k)`` named :data:`MESH_DIMS`. Its rows are consecutive ranks, which launchers
    place on one node: parameters are sharded (and all-gathered / reduce-scattered) within a
    node and only the gradient all-reduce crosses nodes. Under sequence parallelism
    (``sequence_parallel_size = N``) the HSDP mesh replicates over each sequence group (whose
    ranks hold the same parameters and sum their gradients) and shards over the data ranks:
    ``(N, world // N)``, rank ``r`` at ``(r % N, r // N)``."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    k: int | None = config.fsdp_shard_group_size
    sp: int = getattr(config, "sequence_parallel_size", 1)
    if k is None and sp == 1:
        return None
    ensure_process_group()
    world = dist.get_world_size()
    check_shard_group(k, world)
    current = torch.accelerator.current_accelerator()
    device = current.type if current is not None else "cpu"  # fully_shard's default choice
    key = (k if k is not None else -sp, device)  # a sequence-parallel mesh: keyed by -N
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not dist.group.WORLD:
        if k is not None:
            mesh = init_device_mesh(device, (world // k, k), mesh_dim_names=MESH_DIMS)
        else:  # replicate over each sequence group (consecutive ranks), shard over the data ranks
            ranks = torch.arange(world).reshape(world // sp, sp).T
            mesh = DeviceMesh(device, ranks, mesh_dim_names=MESH_DIMS)
        cached = _MESHES[key] = (dist.group.WORLD, mesh)
    return cached[1]


@contextlib.contextmanager
def gradient_sync(accelerator: Any, model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Accumulate locally unless ``sync``: FSDP2 skips its reduce-scatter, DDP its all-reduce."""
    if is_sharded(model):
        cast("FSDPModule", model).set_requires_gradient_sync(sync)
        yield
    elif sync:
        yield
    else:
        with accelerator.no_sync(model):
            yield


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor (gathered on all ranks; sharded only).

    As in ``model.state_dict()``, a parameter shared by several modules (tied embeddings) is one
    tensor under each of its names: the gather copies it once per name, so the copies are tied
    back, and ``save_pretrained`` then drops the tied names (it finds ties by shared storage).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Typed for every option; with full_state_dict=True each value is a (CPU) tensor.
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    return tie_shared(state, model)


def tie_shared(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Point every name of a parameter shared by several modules (tied embeddings) at one tensor
    of ``state`` (in place; returned), as in ``model.state_dict()``: gathers and clones (FSDP2's
    full state dict, accelerate's ZeRO-1/2 state dict) copy it once per name, and
    ``save_pretrained`` finds ties by shared storage only."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state:
            names.setdefault(id(param), []).append(name)
    for tied in names.values():
        for name in tied[1:]:
            state[name] = state[tied[0]]
    return state


def save_dcp(folder: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Model + optimizer state, each process writing its own shards into ``folder/dcp``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, _inner(optimizer))
    with _single_process_quiet():
        # dcp.save/load are torch's documented API; its __init__ re-exports them without
        # __all__, which pyright reads as private.
        dcp.save(  # pyright: ignore[reportPrivateImportUsage]
            {"model": msd, "optimizer": osd}, checkpoint_id=str(folder / DCP_DIR)
        )


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns at every save and load that it assumes one process
    ("torch.distributed is disabled, unavailable or uninitialized ..."); that is exactly what a
    single-process run means (and no process group is made just for a checkpoint), so that one
    warning is dropped. Any other warning, and every warning under a process group, passes."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def load_dcp(folder: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Load ``folder/dcp`` into ``model`` / ``optimizer`` as they are laid out now (any number
    of processes, sharded or not: DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, _inner(optimizer))
    state = {"model": msd, "optimizer": osd}
    with _single_process_quiet():
        dcp.load(  # pyright: ignore[reportPrivateImportUsage] (as dcp.save in save_dcp)
            state, checkpoint_id=str(folder / DCP_DIR)
        )
    set_state_dict(
        model,
        _inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


@contextlib.contextmanager
def preemption_signals(names: list[str], on_signal: Any) -> Iterator[None]:
    """Call ``on_signal(name)`` when one of the signals ``names`` arrives (instead of dying),
    for the duration of the block; the previous handlers come back after. Handlers can only be
    installed from the main thread: elsewhere the block runs without them."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in names:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, lambda signum, frame, n=name: on_signal(n))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def release_process_group(accelerator: Any) -> None:
    """Destroy the process group once nothing holds it (a rank that exits while its peers still
    use the group can abort in gloo's background threads)."""
    import gc

    if dist.is_available() and dist.is_initialized():
        # destroy_process_group only drops c10d's own references: accelerate's list of prepared
        # objects must go too.
        accelerator.free_memory()
        _MESHES.clear()  # their groups die with the world group
        set_sequence_group(None)  # so does the sequence group
        gc.collect()
        dist.destroy_process_group()


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


__all__ = [
    "DCP_DIR",
    "MESH_DIMS",
    "check_shard_group",
    "ensure_process_group",
    "full_state_dict",
    "gradient_sync",
    "is_sharded",
    "load_dcp",
    "preemption_signals",
    "release_process_group",
    "save_dcp",
    "shard_mesh",
    "shard_model",
    "tie_shared",
]
