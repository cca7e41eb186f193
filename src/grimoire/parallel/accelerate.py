"""accelerate's process state: which device a run gets, a clean per-run state, and the check
that a multi-process launch really formed one group (DeepSpeed's part: parallel/deepspeed.py)."""

from __future__ import annotations

import os

import torch
from accelerate.state import AcceleratorState, GradientState


def has_accelerator() -> bool:
    """Whether this machine has an accelerator (CUDA, MPS, XPU, ...) torch can train on."""
    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def reset_accelerate_state() -> None:
    """Let a process build several trainers with different precision (notebooks, sweeps, tests).

    accelerate keeps a process-wide singleton that refuses a second mixed-precision setting; the
    per-process distributed part (PartialState) is kept, only the per-run part is cleared.
    """
    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()


def check_world_size(num_processes: int) -> None:
    """Refuse to train alone when the launcher started several processes.

    accelerate's process state is a per-process singleton: if something built it before the
    trainer (e.g. ``PartialState()`` with its default ``cpu=False`` on a CPU-only machine), every
    torchrun worker would run the whole job by itself and they would overwrite each other's files.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE) but accelerate sees "
            f"{num_processes}; accelerate's process state was created before GrimoireTrainer "
            "with different settings. On a machine without a GPU create it as "
            "PartialState(cpu=True), or let GrimoireTrainer create it first."
        )


__all__ = [
    "check_world_size",
    "has_accelerator",
    "reset_accelerate_state",
]
