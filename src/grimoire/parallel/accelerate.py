"""accelerate's process state: which device a run gets, a clean per-run state, the check that a
multi-process launch really formed one group (DeepSpeed's part: parallel/deepspeed.py), and
DeepSpeed left unimported by runs that do not use it (:func:`keep_deepspeed_unimported`)."""

from __future__ import annotations

import os
import sys

import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import imports as accelerate_imports
from accelerate.utils import other as accelerate_other


def keep_deepspeed_unimported() -> None:
    """Make accelerate's model unwrapping stop importing ``deepspeed`` merely because it is installed.

    ``accelerate.utils.other.extract_model_from_parallel`` (behind ``Accelerator.unwrap_model``
    and every transformers ``save_pretrained``) runs ``from deepspeed import DeepSpeedEngine``
    whenever the package is installed, to test ``isinstance(model, DeepSpeedEngine)``. Importing
    deepspeed costs about a second and prints "[real_accelerator.py:...] Setting accelerator to
    CPU" on every command of a machine without a GPU. A DeepSpeed engine can only exist once
    ``deepspeed`` has been imported (the DeepSpeed runs import it: accelerate's ``prepare``,
    :mod:`grimoire.parallel.deepspeed`), so answering "available" only when it is already in
    ``sys.modules`` leaves that isinstance test exactly as it was. Idempotent.
    """
    if getattr(accelerate_other.is_deepspeed_available, "_grimoire_lazy", False):
        return
    installed = accelerate_imports.is_deepspeed_available

    def imported_and_installed() -> bool:
        return "deepspeed" in sys.modules and bool(installed())

    imported_and_installed._grimoire_lazy = True  # type: ignore[attr-defined]
    accelerate_other.is_deepspeed_available = imported_and_installed


# At import: this module is imported (through the CLI's run builder and the trainer's set-up)
# before any model is saved or unwrapped.
keep_deepspeed_unimported()


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
    """Refuse to train alone when the launcher started several processes, or without the
    process group an earlier trainer's ``close()`` released.

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
    if launched > 1 and not torch.distributed.is_initialized():
        # An earlier trainer's close() destroyed the group, and c10d cannot start another one
        # from the launcher's store (it reads the old group's addresses): DDP failed later and
        # FSDP2 hung.
        raise RuntimeError(
            f"the launcher started {launched} processes, but an earlier trainer in this process "
            "released their process group (trainer.close()): under a launcher, call close() "
            "only on the last trainer of the script"
        )


__all__ = [
    "check_world_size",
    "has_accelerator",
    "keep_deepspeed_unimported",
    "reset_accelerate_state",
]
