"""Metric accumulation across micro-batches, steps and ranks, and the JSONL metrics log."""

from __future__ import annotations

import json
import resource
import time
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
        if not values:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])

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


def means_of(keys: list[str], packed: list[float]) -> dict[str, float]:
    """``{key: sum / weight}`` from ``[sums..., weights...]`` (0.0 where the weight is 0)."""
    n = len(keys)
    return {k: packed[i] / packed[n + i] if packed[n + i] > 0 else 0.0 for i, k in enumerate(keys)}


def _gather_keys(keys: list[str]) -> list[list[str]]:
    from accelerate.utils import gather_object

    return gather_object([keys])


class StepReduction:
    """Everything an optimizer step needs from the other ranks, in ONE all-reduce.

    :meth:`reduce` sums, in a single float64 tensor: the named ``scalars`` (loss units, tokens,
    the stop flag) and the step's metric sums and weights over an agreed, cached key list. The
    first step (or a step where some rank logs a key the list lacks, flagged in the same tensor)
    agrees on the key union with one gather and reduces the metrics once more; every later step
    is one collective.
    """

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.keys: list[str] = []

    def reduce(
        self, scalars: dict[str, float], means: WeightedMeans
    ) -> tuple[dict[str, float], dict[str, float]]:
        acc = self.accelerator
        names = list(scalars)
        local = sorted(means.sums)
        if acc.num_processes == 1:
            self.keys = local
        new_keys = float(any(k not in self.keys for k in local))
        head = torch.tensor(
            [float(scalars[k]) for k in names] + [new_keys], dtype=torch.float64, device=acc.device
        )
        packed = torch.cat([head, means.vector(self.keys, acc.device)])
        if acc.num_processes > 1:
            packed = acc.reduce(packed, reduction="sum")
        values = packed.tolist()  # the step's one host sync
        totals = dict(zip(names, values))
        body = values[len(names) + 1 :]
        if values[len(names)] > 0:  # some rank has a key the agreed list lacks: agree, redo
            self.keys = sorted({k for keys in _gather_keys(local) for k in keys} | set(self.keys))
            body = acc.reduce(means.vector(self.keys, acc.device), reduction="sum").tolist()
        means.clear()
        return totals, means_of(self.keys, body)


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


# The package each ``log_with`` tracker needs (accelerate silently drops a tracker whose package
# is missing, which would leave a run believed to be tracked with no record at all).
TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow-skinny"}
_mlflow_uri_set_by_us: str | None = None


def requested_trackers(log_with: str | list[str] | None) -> list[str]:
    """``log_with`` as a list of tracker names (``None`` -> ``[]``)."""
    if log_with is None:
        return []
    return [log_with] if isinstance(log_with, str) else list(log_with)


def tracker_paths(config: Any) -> dict[str, Path]:
    """Where the local trackers write, from ``output_dir``, ``project_name`` and ``run_name``.

    ``tensorboard``: ``output_dir/tensorboard/<project>[/<run>]``; ``mlflow``: a file store
    ``output_dir/mlruns`` (unless ``MLFLOW_TRACKING_URI`` is set); ``wandb``: its files under
    ``output_dir`` (``<dir>/wandb/``, unless ``WANDB_DIR`` is set).
    """
    out = Path(config.output_dir)
    tensorboard = out / "tensorboard" / project_of(config)
    if config.run_name:
        tensorboard = tensorboard / config.run_name
    return {"tensorboard": tensorboard, "mlflow": out / "mlruns", "wandb": out}


def project_of(config: Any) -> str:
    """The trackers' project: ``project_name``, else ``WANDB_PROJECT``, else ``"grimoire"``."""
    import os

    return config.project_name or os.environ.get("WANDB_PROJECT") or "grimoire"


def init_trackers(accelerator: Any, config: Any) -> None:
    """Start the ``log_with`` trackers on the main process (accelerate logs from it only).

    Every tracker honours ``project_name`` and ``run_name``: the wandb project and run name;
    the mlflow experiment and run name; the tensorboard folder (:func:`tracker_paths`). A
    tracker whose package is missing is an error here, not a silently untracked run.
    Hyper-parameter tables take scalars only, so list and dict values are logged as text.
    """
    import os

    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    from grimoire.errors import ConfigError

    requested = requested_trackers(config.log_with)
    available = {str(t) for t in accelerator.log_with}
    missing = [t for t in requested if t not in available]
    if missing:
        raise ConfigError(
            [
                f"log_with={t!r}: the {TRACKER_PACKAGES[t]!r} package is not installed; "
                f"pip install {TRACKER_PACKAGES[t]} (or grimoire[logging]), or drop {t!r} "
                "from log_with"
                for t in missing
            ],
            title="tracker not available",
        )
    project, run, paths = project_of(config), config.run_name, tracker_paths(config)
    trackers: list[Any] = []
    for name in requested:
        if name == "tensorboard":
            # accelerate's tracker writes to <logging_dir>/<run_name>: name it project[/run].
            sub = paths["tensorboard"].relative_to(config.output_dir)
            trackers.append(TensorBoardTracker(str(sub), config.output_dir))
        elif name == "wandb":
            kwargs: dict[str, Any] = {"name": run} if run else {}
            if "WANDB_DIR" not in os.environ:
                kwargs["dir"] = str(paths["wandb"])
            trackers.append(WandBTracker(project, **kwargs))
        elif name == "mlflow":
            if accelerator.is_main_process:
                _use_local_mlflow_store(paths["mlflow"])
            trackers.append(MLflowTracker(experiment_name=project, run_name=run))
    if accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    accelerator.log_with = trackers
    hparams = {
        k: str(v) if isinstance(v, list | tuple | dict) or v is None else v
        for k, v in config.to_dict().items()
    }
    accelerator.init_trackers(project, config=hparams)


def _use_local_mlflow_store(path: Path) -> None:
    """Point mlflow at a file store under ``output_dir`` unless the user chose a tracking URI
    (``MLFLOW_TRACKING_URI``, or ``mlflow.set_tracking_uri`` before the run); mlflow's own
    default is the current directory, which would mix every run launched from it."""
    import os

    import mlflow
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    global _mlflow_uri_set_by_us
    if "MLFLOW_TRACKING_URI" in os.environ:
        return
    if is_tracking_uri_set() and mlflow.get_tracking_uri() != _mlflow_uri_set_by_us:
        return
    _mlflow_uri_set_by_us = path.resolve().as_uri()
    mlflow.set_tracking_uri(_mlflow_uri_set_by_us)
    # mlflow >= 3.7 refuses a file store unless opted in (it prefers a database, which needs
    # sqlalchemy, absent from mlflow-skinny); a folder beside the run needs no server or db.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def finish_trackers(accelerator: Any) -> None:
    """Close the trackers (flush tensorboard, end the wandb / mlflow runs).

    Unlike ``accelerator.end_training()`` this keeps the process group: the model is usually
    saved after ``train()``, which needs every rank.
    """
    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.trackers = []
