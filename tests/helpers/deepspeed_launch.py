"""The ``accelerate launch`` command line for a DeepSpeed ZeRO run on CPU processes (gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from tests.helpers.train_utils import free_port


def accelerate_deepspeed_config(stage: int, processes: int, folder: Path) -> Path:
    """examples/accelerate/deepspeed_zero<stage>.yaml's settings, on ``processes`` processes."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": processes,
        "mixed_precision": "no",
        "rdzv_backend": "static",
        "same_network": True,
        # not `use_cpu: true`: accelerate turns DeepSpeed off for a CPU run; Grimoire starts
        # DeepSpeed's gloo group itself when the machine has no accelerator.
        "use_cpu": False,
        "deepspeed_config": {
            "zero_stage": stage,
            "gradient_accumulation_steps": 1,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
        },
    }
    path = folder / f"zero{stage}x{processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def deepspeed_launcher(stage: int, processes: int, folder: Path) -> list[str]:
    """``accelerate launch`` with ZeRO-``stage`` on ``processes`` processes and a free port;
    append the script (or ``-m module``) and its arguments."""
    config = accelerate_deepspeed_config(stage, processes, folder)
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
    ]
