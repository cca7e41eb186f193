"""2 processes (gloo, CPU) end with the same parameters as 1 process over the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port

SCRIPT = Path(__file__).parent / "scripts" / "ddp_sft.py"
ROOT = Path(__file__).resolve().parents[1]
# `--multi_gpu` selects accelerate's torchrun launcher; on a CPU-only machine the trainer then
# forms a gloo process group (`--cpu` would run a single process).
LAUNCH = [
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
]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _losses(folder: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # Token budget: ranks get LPT-balanced, bin-packed micro-batches (a different split from
        # the 1-process run; normalising by the global token count keeps the same objective).
        {"max_tokens_per_device": 40},
        # OSFT: each rank decomposes half of the matrices and broadcasts the factors.
        {"osft": True, "osft_unfreeze_rank_ratio": 0.5},
    ],
    ids=["padded", "token-budget", "osft"],
)
def test_two_processes_match_one_process(tiny_dir, tmp_path, extra):
    assert_two_processes_match_one(tiny_dir, tmp_path, extra)


def assert_two_processes_match_one(tiny_dir, tmp_path, extra: dict) -> None:
    """``scripts/ddp_sft.py`` with ``extra``: 2 processes x 2 rows x 2 accumulation end where 1
    process x 4 rows x 2 accumulation does, step by step in the logged loss."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = [str(SCRIPT), str(tiny_dir)]
    subprocess.run(
        [sys.executable, *args, str(one), "4", "2", json.dumps(extra)],
        check=True,
        env=_env(),
        timeout=300,
    )
    subprocess.run(
        [
            *LAUNCH,
            "--main_process_port",
            str(free_port()),
            *args,
            str(two),
            "2",
            "2",
            json.dumps(extra),
        ],
        check=True,
        env=_env(),
        timeout=300,
    )
    a = torch.load(one / "params.pt", weights_only=True)
    b = torch.load(two / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    la, lb = _losses(one), _losses(two)
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, abs=1e-4)
