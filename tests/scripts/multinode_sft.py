"""Run ``ddp_sft.py`` unchanged, then record how this process joined the job.

Usage: multinode_sft.py MODEL_DIR OUT_DIR PER_DEVICE_BATCH GRAD_ACCUM [EXTRA_CONFIG_JSON]
Writes what ddp_sft.py writes, plus OUT_DIR/rank-<RANK>.json per process: the variables the
launcher set (WORLD_SIZE, RANK, GROUP_RANK = node, ...), ``GRIMOIRE_TEST_LAUNCHER`` (set by the
test to tell its launchers apart) and accelerate's view (num_processes, process_index).
"""

import json
import os
import runpy
import sys
from pathlib import Path

DDP_SFT = Path(__file__).with_name("ddp_sft.py")
ENV_KEYS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GRIMOIRE_TEST_LAUNCHER",
)

sys.argv = [str(DDP_SFT), *sys.argv[1:]]
namespace = runpy.run_path(str(DDP_SFT), run_name="__main__")
acc = namespace["trainer"].accelerator
record = {key: os.environ.get(key) for key in ENV_KEYS}
record.update(
    pid=os.getpid(),
    num_processes=acc.num_processes,
    process_index=acc.process_index,
    is_main_process=acc.is_main_process,
    distributed_type=str(acc.distributed_type),
)
rank = os.environ.get("RANK", "single")
Path(sys.argv[2], f"rank-{rank}.json").write_text(json.dumps(record, indent=1) + "\n")
