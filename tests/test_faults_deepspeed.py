"""The non-finite guard under DeepSpeed ZeRO (through accelerate, gloo on CPU).

DeepSpeed steps its engine inside the step's last backward pass, so the guard cannot hold the
step back itself: the engine's ZeRO optimizer checks the gradients for inf/NaN (all-reduced over
ranks) and skips a step that has any, and the guard reads that verdict. A NaN is injected into
one micro-batch's loss on the LAST rank (tests/scripts/nan_step.py), so its gradients are NaN.
Proved on 1 and 2 processes, ZeRO-2 and ZeRO-3: the weights after the skipped step equal those
before it on every rank (ZeRO-3's partitions gathered), the next step changes them, the engine
took one step fewer and the learning rate did not move, ``skipped_steps`` is 1 in metrics.jsonl
and run_summary.json on every rank. Consecutive non-finite steps (the CLI at learning rate 1e6
on 2 processes) stop the run with a non-zero exit, the diverged message and no final model.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.deepspeed_launch import deepspeed_launcher
from tests.helpers.diverging import diverging_run_config
from tests.test_distributed import _env

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).parent / "scripts" / "nan_step.py"


def _params(out: Path, rank: int, step: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"params_{rank}_{step}.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert sorted(a) == sorted(b) and all(v.numel() for v in a.values())  # whole, not partitions
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("stage", "processes"), [(2, 1), (2, 2), (3, 2)])
def test_deepspeed_skips_the_nan_step_on_every_rank(tiny_dir, tmp_path, stage, processes):
    out = tmp_path / "out"
    out.mkdir()
    bad_rank = processes - 1
    cmd = [
        *deepspeed_launcher(stage, processes, tmp_path),
        str(SCRIPT),
        str(tiny_dir),
        str(out),
        "[2]",
    ]
    subprocess.run([*cmd, str(bad_rank), "{}"], check=True, env=_env(), timeout=600)
    for rank in range(processes):
        result = json.loads((out / f"result_{rank}.json").read_text())
        assert result["error"] is None and result["global_step"] == 4, (rank, result)
        assert result["skipped_steps"] == 1 and result["engine_skipped_steps"] == 1
        assert result["optimizer_steps"] == [3.0]  # the engine stepped 3 times in 4 steps
        lrs = result["lrs"]  # linear decay: the skipped step did not move the schedule
        assert lrs[1] == lrs[0] and lrs[2] < lrs[1]
        assert _same(_params(out, rank, 1), _params(out, rank, 2))  # step 2 applied nothing
        assert not _same(_params(out, rank, 2), _params(out, rank, 3))  # step 3 did
        assert all(torch.isfinite(v).all() for v in _params(out, rank, 4).values())
        assert _same(_params(out, 0, 4), _params(out, rank, 4))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records if r["split"] == "train"] == [0, 1, 1, 1]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["diverged"] is None


def test_deepspeed_consecutive_skips_stop_the_cli_nonzero_without_a_final_model(tmp_path):
    """The issue's diverging run (learning rate 1e6) under ZeRO-2 on 2 processes."""
    config, out = diverging_run_config(tmp_path)
    cmd = [*deepspeed_launcher(2, 2, tmp_path), "-m", "grimoire", "train", "--config", str(config)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("grimoire train:")]
    assert errors, done.stderr[-4000:]
    assert all("training diverged: 3 consecutive steps" in line for line in errors)
    assert all("No final model was written" in line for line in errors)
    assert not (out / "final").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["skipped_steps"] >= 3  # 3 in a row stopped it
    # Both ranks write to one pipe: the other rank's warning can land on the same line after it.
    assert errors[0].startswith(f"grimoire train: {summary['diverged']}")
