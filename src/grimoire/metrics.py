"""Metric accumulation across micro-batches, steps and ranks, and the JSONL metrics log."""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else 0.0
    return float(value)


class WeightedMeans:
    """Sums of ``value x weight`` and of weights per key; reduced over ranks on ``compute``.

    Weights are the micro-batches' loss units, so the logged loss is exactly the objective the
    optimizer saw (a token mean for SFT), however the global batch was split.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for key, value in metrics.items():
            self.sums[key] += to_float(value) * weight
            self.weights[key] += weight

    def compute(self, accelerator, reduce: bool = True) -> dict[str, float]:
        keys = sorted(self.sums)
        if reduce and accelerator.num_processes > 1:
            # Ranks may hold different keys (a method that logs something only when it happens):
            # agree on the union first, so the all-reduce below always matches up.
            from accelerate.utils import gather_object

            keys = sorted({k for rank_keys in gather_object([keys]) for k in rank_keys})
        if not keys:
            return {}
        packed = torch.tensor(
            [self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys],
            dtype=torch.float64,
            device=accelerator.device,
        )
        if reduce and accelerator.num_processes > 1:
            packed = accelerator.reduce(packed, reduction="sum")
        n = len(keys)
        out = {
            k: float(packed[i] / packed[n + i]) if packed[n + i] > 0 else 0.0
            for i, k in enumerate(keys)
        }
        self.sums.clear()
        self.weights.clear()
        return out


def peak_memory_mb() -> float:
    """Peak accelerator memory (CUDA) or peak resident set size of this process (CPU), in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class JsonlLogger:
    """Appends one JSON object per logged step / evaluation to ``output_dir/metrics.jsonl``."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled
        self.start = time.time()
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
