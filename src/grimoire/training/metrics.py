"""The run's records: the JSONL metrics log, peak memory, the ``log_with`` trackers, and
:class:`RunLog`, which writes the trainer's train / eval records to both.

Metric means over micro-batches and ranks are :mod:`grimoire.normalise.reduction`.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.normalise.reduction import WeightedMeans
from grimoire.training.integrity import reported_write
from grimoire.training.records import metrics_path


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
            with reported_write("metrics", self.path, self.path.parent), self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class RunLog:
    """Where the trainer's records go: ``metrics.jsonl`` (main process) and the ``log_with``
    trackers; and the train window between two logged steps (the steps' metrics, weighted by
    their loss units, and the tokens behind ``tokens_per_sec``)."""

    def __init__(self, config: TrainingConfig, accelerator: Any):
        self.config, self.accelerator = config, accelerator
        self.jsonl = JsonlLogger(metrics_path(config.output_dir), accelerator.is_main_process)
        self.open_window()

    def begin(self) -> None:
        """Start of ``train()``: a fresh run into an old ``output_dir`` starts a fresh log (a
        resumed one appends); the trackers start."""
        if not self.config.resume_from_checkpoint:
            self.jsonl.reset()
        if self.config.log_with:
            init_trackers(self.accelerator, self.config)

    def end(self) -> None:
        """End of ``train()``: close the trackers (not ``end_training``: it would drop the
        process group that saving the model still needs)."""
        if self.config.log_with:
            finish_trackers(self.accelerator)

    def open_window(self) -> None:
        """Start a fresh train window (at the start of the loop, and after each train record)."""
        self.means = WeightedMeans()
        self.window_tokens, self.window_start = 0.0, time.time()

    def add_step(self, metrics: dict[str, float], units: float, tokens: float) -> None:
        """One optimizer step's global metrics (already reduced over ranks) into the window."""
        self.means.add(metrics, units)
        self.window_tokens += tokens

    def train_record(self, step: int, epoch: float, progress: dict[str, Any]) -> dict[str, Any]:
        """The window as a train record (its mean loss and metrics, throughput, memory), with
        ``progress`` (lr, grad norm, token counts); opens the next window."""
        now = time.time()
        elapsed = max(now - self.window_start, 1e-9)
        metrics = self.means.compute(self.accelerator, reduce=False)  # already global
        record = {
            "split": "train",
            "step": step,
            "epoch": epoch,
            "loss": metrics.pop("loss", float("nan")),
            **progress,
            "tokens_per_sec": self.window_tokens / elapsed,
            "elapsed": now - self.jsonl.start,
            "peak_memory_mb": peak_memory_mb(),
            **metrics,
        }
        self.open_window()
        self.window_start = now
        return record

    def write(self, record: dict[str, Any], step: int) -> None:
        """One record to ``metrics.jsonl`` and, numbers only, to the trackers."""
        self.jsonl.write(record)
        if self.config.log_with:
            numeric = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self.accelerator.log(numeric, step=step)


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
    return config.project_name or os.environ.get("WANDB_PROJECT") or "grimoire"


def init_trackers(accelerator: Any, config: Any) -> None:
    """Start the ``log_with`` trackers on the main process (accelerate logs from it only).

    Every tracker honours ``project_name`` and ``run_name``: the wandb project and run name;
    the mlflow experiment and run name; the tensorboard folder (:func:`tracker_paths`). A
    tracker whose package is missing is an error here, not a silently untracked run.
    Hyper-parameter tables take scalars only, so list and dict values are logged as text.
    """
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

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
