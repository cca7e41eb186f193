"""Sequence parallelism's process layout: a 2-D device mesh ``(data, sequence)``.

``training.sequence_parallel_size = N`` arranges the ``W`` processes as torch's device mesh
``(W / N, N)`` named :data:`MESH_DIMS`; each row of the mesh (``N`` consecutive ranks, one node
on a cluster) is a sequence group that shares one packed row at a time
(:mod:`grimoire.forward.sequence_split`, :mod:`grimoire.model.ulysses_attention`). Parameters
are replicated across a sequence group; each rank's gradient covers the tokens it ran, so the
group's gradients are *summed*. In the trainer that is DDP's own all-reduce over every process
(the sequence groups' sum inside it; the step's rescale by the global loss units, counted once
per group by ``StepReduction(replicas=N)``, undoes DDP's extra ``1/N``); outside it,
:func:`sum_sequence_grads`. With FSDP2 (``distributed: fsdp2``) the parameters are sharded
over the data dimension and replicated over each sequence group, whose gradients FSDP2's own
HSDP all-reduce sums (:func:`grimoire.parallel.fsdp.shard_mesh`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grimoire.contract.method import Method, generating
from grimoire.errors import ConfigError
from grimoire.forward.sequence_split import SequenceGroup, set_sequence_group
from grimoire.losses.online import OnlineMethod
from grimoire.rollout.engines.vllm_common import VLLMSamplerEngine

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


def check_method(size: int, method: Method, packed: bool) -> None:
    """Refuse, before the model is prepared, what is not split: the online methods but GRPO and
    RLOO with synchronous single-turn HF rollouts (:func:`_generating_problems`), reward
    models, and padded micro-batches."""
    if size == 1:
        return
    problems = []
    if generating(method) is not None or method.needs_generation:
        problems += _generating_problems(size, method)
    if method.model_kind != "causal_lm":
        problems.append(
            f"training.sequence_parallel_size={size}: {method.method_name} trains a "
            f"{method.model_kind} model; only causal LM log-probs are split"
        )
    if not packed:
        problems.append(
            f"training.sequence_parallel_size={size} splits packed rows, and this run's "
            "micro-batches are padded (see the 'micro-batches:' log line): set padding_free: true"
        )
    if problems:
        raise ConfigError(problems)


def _generating_problems(size: int, method: Method) -> list[str]:
    """What an online method does that the split does not serve: every forward but the
    completion log-probs of packed rollout rows (GRPO and RLOO have no other), episodes,
    asynchronous rollouts, and vLLM samplers. An engine's sampling runs unsplit on rank 0 of
    each sequence group, which sends the samples to the others (``RolloutEngine.generate``)."""
    key, impl = f"training.sequence_parallel_size={size}", method.implementation
    if not isinstance(impl, OnlineMethod) or not impl.splits_sequences:
        return [
            f"{key}: {method.method_name} runs forwards of its own besides the completion "
            "log-probs of its rollouts (a teacher's logits, pairs, ...), which sequence "
            "parallelism does not split: of the online methods GRPO and RLOO are split; use "
            "sequence_parallel_size: 1"
        ]
    problems = []
    if impl.agent is not None:
        problems.append(
            f"{key}: multi-turn episodes (loss.args tools / environments) are not split"
        )
    if impl.max_staleness >= 1:
        problems.append(
            f"{key}: asynchronous rollouts (loss.args.max_staleness={impl.max_staleness}) are "
            "not split; set max_staleness: 0"
        )
    if isinstance(impl.engine, VLLMSamplerEngine):
        problems.append(
            f"{key}: loss.args.engine {type(impl.engine).__name__} (vLLM) is not split; the "
            "'hf' engine is (rank 0 of each sequence group samples for the group)"
        )
    return problems


def start_sequence_parallel(size: int, method: Method, packed: bool) -> SequenceGroup | None:
    """:func:`check_method`, then build the mesh and make its sequence group the one every
    forward splits over (None, and nothing built, for ``size`` 1).
    :func:`grimoire.parallel.fsdp.release_process_group` ends it."""
    check_method(size, method, packed)
    if size == 1:
        set_sequence_group(None)
        return None
    _, sp = sequence_mesh(size)
    set_sequence_group(sp)
    return sp


def data_parallel(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(data ranks, this process's data rank)``: the mesh's rows are ``size`` consecutive
    ranks (:func:`sequence_mesh`), and every rank of a row reads the same micro-batches."""
    return world_size // size, rank // size


def sequence_mesh(size: int, device: str = "cpu") -> tuple[Any, SequenceGroup]:
    """The ``(data, sequence)`` device mesh over every process, and this process's sequence
    group (the mesh's ``"sequence"`` dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_sequence_parallel(size, world)
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=MESH_DIMS)
    group, data = mesh.get_group("sequence"), mesh.get_group("data")
    return mesh, SequenceGroup(group, mesh.get_local_rank("sequence"), size, data)


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


__all__ = [
    "MESH_DIMS",
    "check_method",
    "check_sequence_parallel",
    "data_parallel",
    "sequence_mesh",
    "start_sequence_parallel",
    "sum_sequence_grads",
]
