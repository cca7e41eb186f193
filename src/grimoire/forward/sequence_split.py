"""Sequence parallelism's row split: each process of a sequence group scores a slice of a row.

With ``training.sequence_parallel_size = N`` one packed ``[1, L]`` row is cut into ``N``
contiguous slices: rank ``r`` of the sequence group runs the model on tokens
``[r * L/N, (r+1) * L/N)`` (the row padded first to a multiple of ``N`` with a padding sample
whose positions restart at 0 and which has no targets). Everything per token is cut the same
way *after* the labels are shifted on the whole row, so the last token of slice ``r`` still
predicts the first token of slice ``r + 1``; ``position_ids`` are the row's own (global), so the
rotary embedding of every slice is the one-process one. Only attention needs the other slices'
tokens: :mod:`grimoire.model.ulysses_attention` exchanges them there.

After the forward, :func:`RowSplit.gather` puts the slices' per-token log-probs back into the
whole ``[1, L]`` row on every rank of the group, so the loss, its token counts and the per-sample
unpacking downstream are the one-process ones, unchanged (each rank computes the same loss
from the same numbers; they are ``L`` floats, not activations). Its backward hands each rank
only its own slice of the row's gradient: the row's loss is counted once, not once per rank, and
the parameter gradients of the group's ranks then *sum* to the one-process gradient
(:func:`grimoire.parallel.sequence.sum_sequence_grads`).

The active group is process-wide state set by the parallel layer
(:func:`set_sequence_group`), read by the forward and by the attention function.

Sampling is not split: :func:`from_leader` runs it on rank 0 of the group alone, with the split
off (:func:`unsplit`: the attention is then the plain per-sample one, with its KV cache), and
hands the result to the group's other ranks, so every rank of the group scores the same rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class SequenceGroup:
    """The processes that share one row: ``size`` of them; this process is ``rank`` among
    them; ``group`` is their process group (a device mesh's ``"sequence"`` dimension).
    ``data``: the process group of the other dimension (the ranks at this process's place in
    every sequence group: each sequence group once), None when nothing split the data."""

    group: Any
    rank: int
    size: int
    data: Any = None


_ACTIVE: dict[str, SequenceGroup | None] = {"group": None}


def set_sequence_group(group: SequenceGroup | None) -> None:
    """Make ``group`` the sequence group of every following forward (None: no splitting)."""
    _ACTIVE["group"] = group if group is not None and group.size > 1 else None


def sequence_group() -> SequenceGroup | None:
    """The active sequence group (None unless sequence parallelism is on, with size > 1)."""
    return _ACTIVE["group"]


@contextmanager
def unsplit() -> Iterator[None]:
    """No sequence group inside the block: forwards see whole rows (sampling with a KV cache,
    which is not split)."""
    kept = _ACTIVE["group"]
    _ACTIVE["group"] = None
    try:
        yield
    finally:
        _ACTIVE["group"] = kept


_T = TypeVar("_T")


def from_leader(fn: Callable[[], _T], everyone: bool = False) -> _T:
    """``fn()`` run by rank 0 of the active sequence group, unsplit, and its result (picklable)
    sent to the group's other ranks; plain ``fn()`` without a group. For sampling: the group's
    ranks must score the same completions, and two ranks drawing with their own random streams
    would not give them. The other ranks do not run ``fn`` unless ``everyone``: a sharded
    policy (FSDP2) all-gathers its parameters inside every forward, over the data ranks, so
    every rank must run as many forwards as its shard group's leaders do; theirs are
    discarded."""
    sp = sequence_group()
    if sp is None:
        return fn()
    box: list[Any] = [None, None]  # (result, the leader's error)
    failure: BaseException | None = None
    if sp.rank == 0 or everyone:
        try:
            with unsplit():
                result = fn()
            if sp.rank == 0:
                box[0] = result
        except Exception as err:  # the other ranks wait in the broadcast: tell them, then raise
            failure = err
            if sp.rank == 0:
                box[1] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(box, group=sp.group, group_src=0)
    if failure is not None:
        raise failure
    if box[1] is not None:
        raise RuntimeError(f"rank 0 of this sequence group failed while sampling: {box[1]}")
    return box[0]


class _GatherRow(torch.autograd.Function):
    """All-gather of ``[B, L/N]`` slices into ``[B, L]`` on every rank; backward: this rank's own
    slice of the incoming gradient, no communication (every rank's loss is the same function of
    the gathered row, so summing the ranks' gradients, as an all-gather's usual reduce-scatter
    backward would, counts the loss N times)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, sp: SequenceGroup) -> Tensor:
        ctx.rank, ctx.width = sp.rank, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(sp.size)]
        dist.all_gather(parts, local.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        grad, start = grads[0], ctx.rank * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None


@dataclass(frozen=True)
class RowSplit:
    """How one ``[B, L]`` row is cut over a sequence group: ``length`` real tokens, padded to
    ``padded`` (a multiple of the group's size), ``padded // size`` per rank."""

    sp: SequenceGroup
    length: int
    padded: int

    @classmethod
    def of(cls, sp: SequenceGroup, length: int) -> RowSplit:
        return cls(sp, length, -(-length // sp.size) * sp.size)

    @property
    def width(self) -> int:
        return self.padded // self.sp.size

    def local(self, row: Tensor, fill: int) -> Tensor:
        """This rank's slice of ``row`` ``[B, L]``, the padding filled with ``fill``."""
        pad = self.padded - self.length
        if pad:
            row = torch.cat([row, row.new_full((row.shape[0], pad), fill)], dim=1)
        start = self.sp.rank * self.width
        return row[:, start : start + self.width]

    def local_positions(self, position_ids: Tensor) -> Tensor:
        """This rank's slice of the row's ``position_ids``; the padding is a sample of its own
        (positions ``0, 1, ...``), so no real token attends to it."""
        pad = self.padded - self.length
        if pad:
            tail = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
            position_ids = torch.cat([position_ids, tail.expand(position_ids.shape[0], -1)], 1)
        start = self.sp.rank * self.width
        return position_ids[:, start : start + self.width]

    def gather(self, local: Tensor) -> Tensor:
        """The whole row ``[B, L]`` from every rank's ``[B, L/N]`` slice (autograd: see
        :class:`_GatherRow`), the padding dropped."""
        full = _GatherRow.apply(local, self.sp)
        return full[:, : self.length]


def gather_positions(local: Tensor, sp: SequenceGroup) -> Tensor:
    """The whole row's ``position_ids`` ``[B, L]`` from this rank's ``[B, L/N]`` (no autograd:
    integers)."""
    parts = [torch.empty_like(local) for _ in range(sp.size)]
    dist.all_gather(parts, local.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)


__all__ = [
    "RowSplit",
    "SequenceGroup",
    "from_leader",
    "gather_positions",
    "sequence_group",
    "set_sequence_group",
    "unsplit",
]
