"""Atomic checkpoints: model + optimizer shards (DCP), scheduler, RNG and data position.

Layout of ``output_dir/checkpoint-<step>/``: ``dcp/`` (model and optimizer state written by
``torch.distributed.checkpoint``, each process its own shards; what a resume reads, on any number
of processes; under DeepSpeed ``deepspeed/`` instead, the engine's own checkpoint, resumed on as
many processes as wrote it), ``model.safetensors`` + ``config.json`` (or ``adapter_model.safetensors`` for
LoRA) and tokenizer files (the ``from_pretrained`` export, gathered on the main process),
``scheduler.pt``, ``rng_state_<rank>.pt`` and ``trainer_state.json``.
Everything is written into ``.tmp-checkpoint-<step>`` first, fsynced and listed with sizes and
checksums in ``manifest.json`` (training/integrity.py), then renamed, so a crash mid-save never
leaves a checkpoint that looks valid but is not, and a checkpoint damaged later is recognised:
``latest`` falls back to the newest complete one, an explicit damaged path is refused.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from grimoire.training.integrity import (
    PREFIX,
    STATE_FILE,
    CheckpointDamaged,
    damage,
    fsync_dir,
    list_checkpoints,
    reported_write,
    seal,
)

#: Where a checkpoint keeps the model and optimizer state it resumes from: DCP shards, or a
#: DeepSpeed engine's own checkpoint (parallel/deepspeed.py's ENGINE_DIR).
MODEL_STATE_DIRS = ("dcp", "deepspeed")

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """Where training is: enough to resume exactly."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps already done in ``epoch``
    tokens_seen: int = 0  # real (non-pad) input tokens of trained micro-batches, all ranks
    loss_units_seen: float = 0.0  # the method's loss units (SFT: labelled tokens; DPO: pairs)
    skipped_steps: int = 0  # steps not applied: a non-finite loss or gradient norm


def at_epoch_end(asked: bool | None, ends_run: bool) -> bool:
    """Whether a complete epoch is checkpointed (``save_on_epoch_end``: ``asked``).

    Auto (None) skips the epoch that ends the run (``ends_run``): the final model is exported at
    that step, and a checkpoint beside it (optimizer state included) only costs its size several
    times over. A run stopped by a checkpoint signal still gets its own checkpoint in
    ``train()``; a diverged one gets none. True / False: every epoch, or none.
    """
    return not ends_run if asked is None else asked


def resolve_resume_path(spec: str, output_dir: str | Path, rank: int = 0) -> Path | None:
    """``"latest"`` -> the newest complete checkpoint in ``output_dir`` (None if there is none;
    damaged newer ones are skipped, and said so); else the path, refused when damaged.

    Raises:
        CheckpointDamaged: the explicit checkpoint, or every checkpoint for ``"latest"``, does
            not match its manifest (the message names the file).
    """
    if spec == "latest":
        skipped = []
        for path in reversed(list_checkpoints(output_dir)):
            why = damage(path)
            if why is None:
                if skipped and rank == 0:
                    logger.warning(
                        "resume_from_checkpoint='latest': skipped the damaged %s; resuming from "
                        "the newest complete checkpoint, %s",
                        "; ".join(skipped),
                        path,
                    )
                return path
            skipped.append(f"{path.name} ({why})")
        if skipped:
            raise CheckpointDamaged(
                f"resume_from_checkpoint='latest': every checkpoint in {output_dir} is damaged: "
                f"{'; '.join(skipped)}. Start without resume_from_checkpoint, or restore a copy."
            )
        return None
    path = Path(spec)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(
            f"resume_from_checkpoint={spec!r}: no {STATE_FILE} there; pass a checkpoint-<step> "
            f"folder or 'latest'"
        )
    why = damage(path)
    if why is not None:
        raise CheckpointDamaged(damaged_message(spec, path, why))
    return path


def damaged_message(spec: str, path: Path, why: str) -> str:
    """Why an explicitly named checkpoint is refused, and what to resume from instead."""
    others = [p for p in list_checkpoints(path.parent) if p != path and damage(p) is None]
    instead = f"; the newest complete checkpoint beside it is {others[-1]}" if others else ""
    return (
        f"resume_from_checkpoint={spec!r} is damaged: {why}{instead}. Resume from another "
        "checkpoint (or 'latest', which skips damaged ones), or restore this one from a copy."
    )


def rng_state() -> dict[str, Any]:
    np_state = cast(tuple[Any, ...], np.random.get_state())  # legacy=True: the 5-tuple
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_state(folder: Path, state: TrainerState, extra: dict[str, Any] | None = None) -> None:
    data = {**asdict(state), **(extra or {})}
    (folder / STATE_FILE).write_text(json.dumps(data, indent=2))


def read_state(folder: Path) -> TrainerState:
    data = json.loads((folder / STATE_FILE).read_text())
    if "loss_tokens_seen" in data:  # the name before 0.2 (it always counted loss units)
        data.setdefault("loss_units_seen", data.pop("loss_tokens_seen"))
    fields = TrainerState.__dataclass_fields__
    return TrainerState(**{k: v for k, v in data.items() if k in fields})


def torch_load(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers (never arbitrary pickles)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def begin(output_dir: Path, step: int) -> tuple[Path, Path]:
    """(temporary folder to write into, final folder) for checkpoint ``step``."""
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f".tmp-{PREFIX}{step}"
    return tmp, final


def commit(tmp: Path, final: Path) -> None:
    """Atomically and durably publish a fully written checkpoint folder: its files and manifest
    fsynced before the rename, the parent folder after it."""
    seal(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def rotate(output_dir: Path, limit: int | None) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``; returns the deleted folders."""
    if limit is None:
        return []
    ckpts = list_checkpoints(output_dir)
    doomed = ckpts[: max(0, len(ckpts) - limit)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def save(
    root: Path,
    step: int,
    accelerator: Any,
    write_model: Any,
    scheduler: Any,
    state: TrainerState,
    extra_state: dict[str, Any],
    save_total_limit: int | None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically: everything goes into a temporary folder that is
    renamed only once every rank has written its part (``write_model(folder)`` writes the model
    and optimizer state, every rank taking part).
    """
    tmp, final = begin(root, step)
    with reported_write(f"checkpoint {final.name}", tmp, root, temporary=tmp):
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        write_model(tmp)
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            write_state(tmp, state, extra_state)
        torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            commit(tmp, final)
    if accelerator.is_main_process:
        rotate(root, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def resume(path: Path, load_model: Any, scheduler: Any, rank: int) -> TrainerState:
    """Restore model + optimizer (``load_model(path)``: the DCP shards, resharded to however
    many processes run now, or a DeepSpeed engine's state), scheduler and, when the process
    count is unchanged, this rank's RNG; returns the saved :class:`TrainerState`."""
    if not any((path / d).is_dir() for d in MODEL_STATE_DIRS):
        raise FileNotFoundError(
            f"{path} has no dcp/ (or deepspeed/) folder: it was written by an older Grimoire; resume it with that "
            "version, or start from its weights (model.safetensors) as a new run"
        )
    load_model(path)
    scheduler.load_state_dict(torch_load(path / "scheduler.pt"))
    rng_file = path / f"rng_state_{rank}.pt"
    if rng_file.exists():
        set_rng_state(torch_load(rng_file))
    return read_state(path)


def resume_if_any(
    spec: str, output_dir: str | Path, load_model: Any, scheduler: Any, rank: int
) -> TrainerState | None:
    """:func:`resume` from ``spec`` (a folder or ``"latest"``); None when ``"latest"`` finds no
    checkpoint yet (a fresh start, so a preemptible job can always pass ``"latest"``)."""
    path = resolve_resume_path(spec, output_dir, rank)
    if path is None:
        logger.info("resume_from_checkpoint='latest' but no checkpoint yet: starting fresh")
        return None
    state = resume(path, load_model, scheduler, rank)
    if rank == 0:  # a warning so the command shows it: which checkpoint this run continues
        logger.warning("resumed from %s at step %d", path, state.global_step)
    return state


def report_preemption(signal_name: str, step: int, path: Path) -> None:
    """The one message of a run stopped by a signal: where its checkpoint is, how to resume."""
    logger.warning(
        "stopped by %s after step %d; checkpoint: %s. Resume with resume_from_checkpoint="
        "'latest' and the same output_dir (CLI: the same command plus "
        "--set training.resume_from_checkpoint=latest).",
        signal_name,
        step,
        path,
    )
