"""2 processes (gloo, CPU) end with the same parameters as 1 process over the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_sft.py"
ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def test_two_processes_match_one_process(tiny_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_dir), str(one), "4", "2"],
        check=True,
        env=_env(),
        timeout=300,
    )
    # `--multi_gpu` selects accelerate's torchrun launcher; on a CPU-only machine the trainer then
    # forms a gloo process group (`--cpu` would run a single process).
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "29517",
    ]
    subprocess.run(
        [*launch, str(SCRIPT), str(tiny_dir), str(two), "2", "2"],
        check=True,
        env=_env(),
        timeout=300,
    )
    a = torch.load(one / "params.pt", weights_only=True)
    b = torch.load(two / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    la = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(la) == len(lb) == 3
    for x, y in zip(la, lb):
        assert abs(x - y) < 1e-4
