"""Metric means across micro-batches, steps and ranks: each value weighted by its loss units.

:class:`WeightedMeans` accumulates a step's (or an evaluation's) metrics; :class:`StepReduction`
sums, over ranks, everything an optimizer step needs in ONE all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object


class WeightedMeans:
    """Sums of ``value x weight`` and of weights per key; reduced over ranks on ``compute``.

    Weights are the micro-batches' loss units, so the logged loss is exactly the objective the
    optimizer saw (a token mean for SFT), however the global batch was split. Values stay
    tensors until reduced (no host sync per micro-batch). A key added with weight 0 (a dummy, a
    micro-batch with nothing to train) is registered but adds nothing, so every rank that runs
    the method knows the same keys.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for key, value in metrics.items():
            self.sums.setdefault(key, 0.0)
            self.weights.setdefault(key, 0.0)
            if weight > 0:
                v = value.detach().float().mean() if isinstance(value, torch.Tensor) else value
                self.sums[key] = self.sums[key] + v * weight
                self.weights[key] += weight

    def vector(self, keys: list[str], device: Any) -> torch.Tensor:
        """``[sums..., weights...]`` of ``keys`` (missing keys: 0) as one float64 tensor."""
        values = [self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys]
        return packed_vector(values, device)

    def clear(self) -> None:
        self.sums.clear()
        self.weights.clear()

    def compute(self, accelerator, reduce: bool = True) -> dict[str, float]:
        keys = sorted(self.sums)
        if reduce and accelerator.num_processes > 1:
            # Ranks may hold different keys: agree on the union first, so the all-reduce below
            # always matches up (evaluation; the step uses StepReduction's cached key list).
            keys = sorted({k for rank_keys in _gather_keys(keys) for k in rank_keys})
        if not keys:
            return {}
        packed = self.vector(keys, accelerator.device)
        if reduce and accelerator.num_processes > 1:
            packed = accelerator.reduce(packed, reduction="sum")
        self.clear()
        return means_of(keys, packed.tolist())


def packed_vector(values: list[Any], device: Any) -> torch.Tensor:
    """``values`` (host numbers and device scalar tensors, in any mix) as one float64 tensor on
    ``device``, without waiting on the device: the host numbers travel in ONE non-blocking copy
    (a blocking host-to-device copy per number would each wait for the queued kernels), the
    device scalars are written in on the device."""
    device = torch.device(device)
    where = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    host = torch.tensor(
        [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values], dtype=torch.float64
    )
    out = host.to(device, non_blocking=device.type != "cpu")
    if where:
        scalars = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in where])
        index = torch.tensor(where).to(device, non_blocking=device.type != "cpu")
        out = out.index_copy(0, index, scalars.to(device))
    return out


def means_of(keys: list[str], packed: list[float]) -> dict[str, float]:
    """``{key: sum / weight}`` from ``[sums..., weights...]`` (0.0 where the weight is 0)."""
    n = len(keys)
    return {k: packed[i] / packed[n + i] if packed[n + i] > 0 else 0.0 for i, k in enumerate(keys)}


def _gather_keys(keys: list[str]) -> list[list[str]]:
    return gather_object([keys])


class StepReduction:
    """Everything an optimizer step needs from the other ranks, in ONE all-reduce.

    :meth:`reduce` sums, in a single float64 tensor: the named ``scalars`` (loss units, tokens,
    the stop flag) and the step's metric sums and weights over an agreed, cached key list. The
    first step (or a step where some rank logs a key the list lacks, flagged in the same tensor)
    agrees on the key union with one gather and reduces the metrics once more; every later step
    is one collective.

    ``replicas``: how many ranks hold each rank's numbers (a sequence group's ranks all score the
    same rows, :mod:`grimoire.parallel.sequence`): the summed scalars are divided by it, so loss
    units and tokens are counted once; metric means are ratios of two sums, unchanged by it.
    """

    def __init__(self, accelerator: Any, replicas: int = 1):
        self.accelerator = accelerator
        self.replicas = replicas
        self.keys: list[str] = []

    def reduce(
        self, scalars: dict[str, Any], means: WeightedMeans
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Sum ``scalars`` (host numbers, or device scalars such as the gradient norm: summed
        over ranks like the rest) and ``means`` over ranks; ONE read back to the host."""
        acc = self.accelerator
        names = list(scalars)
        local = sorted(means.sums)
        if acc.num_processes == 1:
            self.keys = local
        new_keys = float(any(k not in self.keys for k in local))
        head = [
            scalars[k] if isinstance(scalars[k], torch.Tensor) else float(scalars[k]) for k in names
        ]
        packed = torch.cat(
            [packed_vector([*head, new_keys], acc.device), means.vector(self.keys, acc.device)]
        )
        if acc.num_processes > 1:
            packed = acc.reduce(packed, reduction="sum")
        values = packed.tolist()  # the step's one host sync
        totals = {k: v / self.replicas for k, v in zip(names, values)}
        body = values[len(names) + 1 :]
        if values[len(names)] > 0:  # some rank has a key the agreed list lacks: agree, redo
            self.keys = sorted({k for keys in _gather_keys(local) for k in keys} | set(self.keys))
            body = acc.reduce(means.vector(self.keys, acc.device), reduction="sum").tolist()
        means.clear()
        return totals, means_of(self.keys, body)


__all__ = ["StepReduction", "WeightedMeans", "means_of", "packed_vector"]
