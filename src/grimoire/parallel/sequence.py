"""Sequence parallelism's process layout: a 2-D device mesh ``(data, sequence)``.

``training.sequence_parallel_size = N`` arranges the ``W`` processes as torch's device mesh
``(W / N, N)`` named :data:`MESH_DIMS`; each row of the mesh (``N`` consecutive ranks, one node
on a cluster) is a sequence group that shares one packed row at a time
(:mod:`grimoire.forward.sequence_split`, :mod:`grimoire.model.ulysses_attention`). Parameters
are replicated across a sequence group; each rank's gradient covers the tokens it ran, so the
group's gradients are *summed* (:func:`sum_sequence_grads`: one all-reduce over the sequence
dimension, this slice's choice; FSDP2 on the data dimension is not wired yet).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grimoire.errors import ConfigError
from grimoire.forward.sequence_split import SequenceGroup

#: Dimension names of the sequence-parallel mesh: dim 0 splits the data, dim 1 the rows' tokens.
MESH_DIMS = ("data", "sequence")


def check_sequence_parallel(size: int, world_size: int) -> None:
    """Refuse a sequence group that does not divide the processes (before the model is built)."""
    if world_size % size:
        raise ConfigError(
            [
                f"training.sequence_parallel_size={size} does not divide the {world_size} "
                f"processes of this run: set it to a divisor of {world_size} (each group of "
                f"{size} consecutive processes shares one row)"
            ]
        )


def sequence_mesh(size: int, device: str = "cpu") -> tuple[Any, SequenceGroup]:
    """The ``(data, sequence)`` device mesh over every process, and this process's sequence
    group (the mesh's ``"sequence"`` dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_sequence_parallel(size, world)
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=MESH_DIMS)
    group = mesh.get_group("sequence")
    return mesh, SequenceGroup(group, mesh.get_local_rank("sequence"), size)


def sum_sequence_grads(model: torch.nn.Module, sp: SequenceGroup) -> None:
    """Sum every parameter's gradient over the sequence group, in place: each rank's gradient
    holds its own tokens' share of the row's loss (the row's loss is counted once across the
    group, :class:`grimoire.forward.sequence_split.RowSplit`), so the sum is the whole row's.
    One flat all-reduce per dtype rather than one per parameter."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=sp.group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


__all__ = ["MESH_DIMS", "check_sequence_parallel", "sequence_mesh", "sum_sequence_grads"]
