"""What a run leaves behind for people: ``run_summary.json`` and a model card (``README.md``).

Both are written by the main process only, from what the trainer already knows (its state, its
config, ``metrics.jsonl``), so they never disagree with the metrics log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from grimoire.contract.method import Method
from grimoire.model.precision import cpu_capability, decide
from grimoire.training.checkpoint import PREFIX
from grimoire.training.integrity import reported_write
from grimoire.training.metrics import peak_memory_mb
from grimoire.training.records import metrics_path, read_records

logger = logging.getLogger(__name__)

SUMMARY_FILE = "run_summary.json"
CARD_FILE = "README.md"
#: The version a source checkout reports when grimoire is not installed as a distribution. Kept
#: here (equal to pyproject's) rather than read from ``grimoire.__version__``: the training layer
#: does not import the package root, whose public facade sits above it.
SOURCE_VERSION = "0.1.0"


# --------------------------------------------------------------------------- shared helpers


def last_records(records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last train and the last eval record (``{}`` where there is none)."""
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    return (train[-1] if train else {}), (evals[-1] if evals else {})


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader (or a
    crash) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with reported_write(path.name, path, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(text, encoding="utf-8")
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)


def grimoire_version() -> str:
    """The installed grimoire's version (:data:`SOURCE_VERSION` for a bare source checkout)."""
    try:
        return version("grimoire")
    except PackageNotFoundError:  # not installed as a distribution (a source checkout on sys.path)
        return SOURCE_VERSION


def checkpoints_in(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders of ``output_dir``, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def folder_bytes(path: str | Path) -> int:
    """The bytes of every file under ``path`` (links not followed): its size on disk, as far
    as a user deciding what to keep or delete is concerned."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            # A file removed meanwhile (a rotated checkpoint) is not there any more.
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def human_size(size: int) -> str:
    """``2362232012`` -> ``2.2 GiB`` (binary units, one decimal)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def written_entry(kind: str, path: str | Path) -> dict[str, Any]:
    """One folder the run wrote, for ``run_summary.json``'s ``written``: what it is (``checkpoint``
    or ``model``), where, and its size on disk."""
    return {"kind": kind, "path": str(path), "bytes": folder_bytes(path)}


def written_text(summary: dict[str, Any]) -> list[str]:
    """``run_summary.json``'s ``written`` as lines: kind, path, size (the printed summary)."""
    entries = summary.get("written") or []
    if not entries:
        return []
    width = max(len(str(e["path"])) for e in entries)
    lines = ["written:"]
    for e in entries:
        kind = "final model" if e["kind"] == "model" else e["kind"]
        lines.append(f"  {kind:<11}  {e['path']!s:<{width}}  {human_size(e['bytes'])}")
    return lines


# --------------------------------------------------------------------------- run summary


def run_summary(trainer: Any, started: float, tokens_before: int = 0) -> dict[str, Any]:
    """The run's key figures. ``started`` is the ``time.time()`` at which this ``train()`` call
    began and ``tokens_before`` the tokens already seen then (a resumed run), so ``tokens_per_sec``
    is this call's rate; ``tokens`` is the run's total."""
    cfg, state = trainer.config, trainer.state
    records = read_records(cfg.output_dir)
    losses = [r["loss"] for r in records if r.get("split") == "train" and "loss" in r]
    _, last_eval = last_records(records)
    wall = max(time.time() - started, 1e-9)
    checkpoints = checkpoints_in(cfg.output_dir)
    return {
        "steps": state.global_step,
        "max_steps": trainer.max_steps,
        "stopped_early": bool(trainer.stopped_early),
        "preempted_by": trainer.preempted_by,
        "skipped_steps": state.skipped_steps,
        "diverged": getattr(getattr(trainer, "guard", None), "failure", None),
        "epoch": state.epoch,
        "tokens": state.tokens_seen,
        "loss_units": state.loss_units_seen,
        "wall_time_s": round(wall, 3),
        "tokens_per_sec": (state.tokens_seen - tokens_before) / wall,
        "peak_memory_mb": round(peak_memory_mb(), 1),
        "precision": _precision(cfg.mixed_precision),
        "packed": bool(getattr(trainer, "packed", False)),
        "activation_checkpointing": bool(getattr(trainer, "checkpointing", (False,))[0]),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "eval": {k: v for k, v in last_eval.items() if k.startswith("eval/")},
        "output_dir": str(cfg.output_dir),
        "metrics": str(metrics_path(cfg.output_dir)),
        "checkpoints": [str(p) for p in checkpoints],
        "saved_model": None,  # filled in by save_model
        # The folders left on disk and their sizes (a checkpoint holds the optimizer state too:
        # several times the model); save_model adds the final model's.
        "written": [written_entry("checkpoint", p) for p in checkpoints],
    }


def _precision(requested: str) -> dict[str, str]:
    """What ``mixed_precision`` ran as on this machine, and why (``auto`` depends on it)."""
    resolved, why = decide(requested)
    return {"requested": requested, "resolved": resolved, "why": why, "cpu": cpu_capability()}


def summary_text(summary: dict[str, Any]) -> str:
    """A few lines for the log (the CLI prints its own longer, curve-and-eval summary)."""
    stop = ""
    if summary["preempted_by"]:
        stop = f" (stopped by {summary['preempted_by']})"
    elif summary["stopped_early"]:
        stop = " (stopped early)"
    loss = ""
    if summary["loss_first"] is not None:
        loss = f", loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}"
    sizes = {e["path"]: e["bytes"] for e in summary.get("written") or []}
    where = "none"
    if summary["checkpoints"]:
        last = summary["checkpoints"][-1]
        size = f" ({human_size(sizes[last])})" if last in sizes else ""
        where = f"{last}{size}" + (
            f", {len(summary['checkpoints'])} in all" if len(summary["checkpoints"]) > 1 else ""
        )
    return (
        f"run: {summary['steps']}/{summary['max_steps']} steps{stop} in "
        f"{summary['wall_time_s']:.1f}s, {summary['tokens']} tokens "
        f"({summary['tokens_per_sec']:.0f} tok/s), peak memory "
        f"{summary['peak_memory_mb']:.0f} MiB{loss}; latest checkpoint: {where}; "
        f"summary: {Path(summary['output_dir']) / SUMMARY_FILE}"
    )


def write_run_summary(
    trainer: Any, started: float, tokens_before: int = 0
) -> dict[str, Any] | None:
    """Log the summary and write ``output_dir/run_summary.json`` (main process; None elsewhere)."""
    if not trainer.accelerator.is_main_process:
        return None
    summary = run_summary(trainer, started, tokens_before)
    write_atomic(Path(trainer.config.output_dir) / SUMMARY_FILE, json.dumps(summary, indent=2))
    logger.info(summary_text(summary))
    return summary


def note_saved_model(output_dir: str | Path, model_dir: str | Path) -> None:
    """Record where the model was saved in an existing ``run_summary.json``."""
    path = Path(output_dir) / SUMMARY_FILE
    if not path.is_file():
        return  # saved before (or without) training: nothing to update
    summary = json.loads(path.read_text(encoding="utf-8"))
    summary["saved_model"] = str(model_dir)
    # Saved again to the same folder: one entry, the newest size.
    kept = [e for e in summary.get("written") or [] if e["path"] != str(model_dir)]
    summary["written"] = [*kept, written_entry("model", model_dir)]
    write_atomic(path, json.dumps(summary, indent=2))
    logger.info("final model: %s (%s)", model_dir, human_size(summary["written"][-1]["bytes"]))


# --------------------------------------------------------------------------- model card


def base_model_of(model: Any) -> str | None:
    """The ``from_pretrained`` name or folder the model was loaded from (peft models too)."""
    for obj in (model, getattr(model, "base_model", None), getattr(model, "model", None)):
        if obj is None:
            continue
        name = getattr(obj, "name_or_path", None) or getattr(
            getattr(obj, "config", None), "_name_or_path", None
        )
        if isinstance(name, str) and name:
            return name
    return None


def method_params(loss_fn: Method) -> dict[str, Any]:
    """The method's public scalar settings (``beta``, ``loss_type``, ...), as its attributes."""
    return {
        k: v
        for k, v in sorted(vars(loss_fn.implementation).items())
        if not k.startswith("_") and isinstance(v, bool | int | float | str)
    }


def method_tag(loss_fn: Method) -> str:
    """``DPOLoss`` -> ``dpo``, ``GRPOMethod`` -> ``grpo``: a tag for the card's front matter."""
    name = loss_fn.method_name
    for suffix in ("Loss", "Method"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name.lower()


def _rows(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an iterable without a length
        return None


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=True).rstrip()


def _metric_lines(record: dict[str, Any], skip: tuple[str, ...]) -> list[str]:
    return [
        f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in record.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    ]


def model_card(trainer: Any, model_dir: str | Path) -> str:
    """The card's Markdown: front matter, base model, method, data, training, final metrics,
    and the exact command and config to train it again."""
    loss_fn = trainer.loss_fn
    model = trainer.unwrapped_model
    base = base_model_of(model)
    adapter = hasattr(model, "peft_config")
    tags = ["grimoire", method_tag(loss_fn)] + (["lora"] if adapter else [])
    front = {"library_name": "grimoire", "base_model": base, "tags": tags}
    method = loss_fn.method_name
    launch = getattr(trainer, "launch", None)
    lines = [f"---\n{_yaml(front)}\n---", "", f"# {Path(model_dir).name}", ""]
    what = "a LoRA adapter for" if adapter else "fine-tuned from"
    lines += [
        f"{what.capitalize()} `{base}` with grimoire {grimoire_version()}, method `{method}`.",
        "",
    ]
    lines += _method_section(method, method_params(loss_fn))
    lines += _data_section(trainer, launch)
    lines += _training_section(trainer)
    lines += _metrics_section(read_records(trainer.config.output_dir))
    lines += _reproduce_section(launch, method, trainer.config)
    return "\n".join(lines)


def _method_section(method: str, params: dict[str, Any]) -> list[str]:
    lines = ["## Method", "", f"`{method}`" + (" with:" if params else " (no settings)."), ""]
    if params:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in params.items()]
        lines.append("")
    return lines


def _data_section(trainer: Any, launch: dict[str, Any] | None) -> list[str]:
    """Row counts, and the dataset sections of the config the run was launched with."""
    lines = ["## Data", "", f"- train rows: {_rows(trainer.train_dataset)}"]
    if trainer.eval_dataset is not None:
        lines.append(f"- eval rows: {_rows(trainer.eval_dataset)}")
    if launch and isinstance(launch.get("config"), dict):
        for key in ("dataset", "eval_dataset"):
            if key in launch["config"]:
                lines += ["", f"`{key}`:", "", "```yaml", _yaml(launch["config"][key]), "```"]
    return lines


def _training_section(trainer: Any) -> list[str]:
    state = trainer.state
    return [
        "",
        "## Training",
        "",
        f"- steps: {state.global_step} of {trainer.max_steps}"
        + (" (stopped early)" if trainer.stopped_early else ""),
        f"- tokens: {state.tokens_seen}",
        f"- loss units: {state.loss_units_seen:g}",
        f"- epochs completed: {state.epoch}",
        "",
    ]


def _metrics_section(records: list[dict[str, Any]]) -> list[str]:
    """The last train and eval records of ``metrics.jsonl``, as tables."""
    last_train, last_eval = last_records(records)
    lines = ["## Final metrics", ""]
    if not (last_train or last_eval):
        lines += ["No metrics were logged.", ""]
    for title, record in (("train", last_train), ("eval", last_eval)):
        if record:
            lines += [f"Last {title} record (step {record.get('step')}):", ""]
            lines += ["| metric | value |", "|---|---|"]
            lines += _metric_lines(record, skip=("step", "split"))
            lines.append("")
    return lines


def _reproduce_section(launch: dict[str, Any] | None, method: str, config: Any) -> list[str]:
    """The command and config the run was launched with, or the Python run's config."""
    lines = ["## Reproduce", ""]
    if launch:
        if launch.get("command"):
            lines += ["```bash", str(launch["command"]), "```", ""]
        if launch.get("config") is not None:
            lines += ["with this config:", "", "```yaml", _yaml(launch["config"]), "```", ""]
        return lines
    return lines + [
        f"Launched from Python (`GrimoireTrainer` with `{method}`); its `TrainingConfig`:",
        "",
        "```yaml",
        _yaml(config.to_dict()),
        "```",
        "",
    ]


def write_model_card(trainer: Any, model_dir: str | Path) -> Path | None:
    """Write ``model_dir/README.md`` (main process only; None elsewhere)."""
    if not trainer.accelerator.is_main_process:
        return None
    path = Path(model_dir) / CARD_FILE
    write_atomic(path, model_card(trainer, model_dir))
    return path


__all__ = [
    "folder_bytes",
    "human_size",
    "model_card",
    "note_saved_model",
    "run_summary",
    "write_model_card",
    "write_run_summary",
    "written_entry",
    "written_text",
]
