"""The non-finite guard: a step whose loss (so gradient) is NaN is not applied, on every rank.

A NaN is injected into one micro-batch's loss (tests/scripts/nan_step.py), so the step's
gradients are NaN too. Proved: the weights after the skipped step equal those before it, the
optimizer took no step (its own step count) and the scheduler did not move (the learning rate);
with 2 gloo processes (DDP and FSDP2) a NaN on rank 1 only makes BOTH ranks skip the same step;
consecutive skips stop the run with one message, a non-zero exit and no final model (the
issue's diverging CLI run, learning rate 1e6).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.commands import grimoire_command, run
from tests.helpers.diverging import diverging_run_config
from tests.helpers.train_utils import free_port
from tests.test_distributed import LAUNCH, _env

from grimoire.training.guard import NonFiniteGuard
from grimoire.training.step import mark_nonfinite, marked, nonfinite

SCRIPT = Path(__file__).parent / "scripts" / "nan_step.py"


def _run(tiny_dir, out, bad, bad_rank=0, processes=1, **extra):
    args = [str(SCRIPT), str(tiny_dir), str(out), json.dumps(bad), str(bad_rank)]
    args.append(json.dumps(extra))
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [*LAUNCH, "--main_process_port", str(free_port()), *args]
    subprocess.run(cmd, check=True, env=_env(), timeout=300)
    return [json.loads((out / f"result_{r}.json").read_text()) for r in range(processes)]


def _params(out, rank, step):
    return torch.load(out / f"params_{rank}_{step}.pt", weights_only=True)


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_step_is_skipped_and_changes_nothing(tiny_dir, tmp_path):
    (result,) = _run(tiny_dir, tmp_path, bad=[2])
    assert result["skipped_steps"] == 1 and result["global_step"] == 4 and result["error"] is None
    assert _same(_params(tmp_path, 0, 1), _params(tmp_path, 0, 2))  # step 2 applied nothing
    assert not _same(_params(tmp_path, 0, 2), _params(tmp_path, 0, 3))  # step 3 did
    assert all(torch.isfinite(v).all() for v in _params(tmp_path, 0, 4).values())
    assert result["optimizer_steps"] == [3.0]  # Adam stepped 3 times in 4 steps
    lrs = result["lrs"]  # linear decay: the skipped step did not move the schedule
    assert lrs[1] == lrs[0] and lrs[2] < lrs[1]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records if r["split"] == "train"] == [0, 1, 1, 1]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["diverged"] is None


@pytest.mark.parametrize("distributed", ["ddp", "fsdp2"])
def test_every_rank_skips_the_step_a_nan_on_one_rank_breaks(tiny_dir, tmp_path, distributed):
    results = _run(tiny_dir, tmp_path, bad=[2], bad_rank=1, processes=2, distributed=distributed)
    for rank, result in enumerate(results):
        assert result["skipped_steps"] == 1, (rank, result)
        assert result["error"] is None
        assert _same(_params(tmp_path, rank, 1), _params(tmp_path, rank, 2))
        assert not _same(_params(tmp_path, rank, 2), _params(tmp_path, rank, 3))
    assert _same(_params(tmp_path, 0, 4), _params(tmp_path, 1, 4))


def test_consecutive_skips_stop_the_run_with_one_message(tiny_dir, tmp_path):
    (result,) = _run(tiny_dir, tmp_path, bad=[2, 3, 4], max_consecutive_skipped_steps=2)
    assert result["global_step"] == 3 and result["skipped_steps"] == 2
    assert result["error"].startswith(
        "training diverged: 2 consecutive steps up to step 3 had a non-finite loss or gradient norm"
    )
    assert "micro-batch(es) [0]" in result["error"]
    assert "the last finite loss was" in result["error"] and "at step 1" in result["error"]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["diverged"] == result["error"] and summary["skipped_steps"] == 2


def test_a_diverging_cli_run_exits_1_without_a_final_model(tmp_path):
    """The reported run: learning rate 1e6 used to log NaN losses, exit 0 and save a NaN model."""
    config, out = diverging_run_config(tmp_path)
    done = run([*grimoire_command(), "train", "--config", str(config)], tmp_path, expect=1)
    errors = [line for line in done.stderr.splitlines() if line.startswith("grimoire train:")]
    assert len(errors) == 1, done.stderr
    assert "training diverged: 3 consecutive steps" in errors[0]
    assert "No final model was written" in errors[0]
    assert not (out / "final").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["skipped_steps"] >= 3 and summary["steps"] < 30


def test_the_flags_read_with_the_step():
    """The mask names the micro-batches whose loss is not finite (a weight-0 filler is not
    marked); an engine's float norm of nan means "no norm" (DeepSpeed), never a skip."""
    mask = 0.0
    losses = [1.0, float("nan"), 2.0, float("inf"), float("nan")]
    for i, (loss, weight) in enumerate(zip(losses, [1, 1, 1, 1, 0])):
        mask = mark_nonfinite(mask, torch.tensor(loss), i, weight)
    assert marked(float(mask)) == [1, 3]
    assert nonfinite(float("nan")) == 0.0 and nonfinite(float("inf")) == 1.0
    assert nonfinite(float("nan"), measured=True) == 1.0 and nonfinite(3.0, measured=True) == 0.0
    assert float(nonfinite(torch.tensor(float("nan")))) == 1.0
    assert float(nonfinite(torch.tensor(2.0))) == 0.0


class _Engine:
    """A DeepSpeed engine's verdict on its last step, as the guard reads it."""

    def __init__(self, applied: bool, fp16: bool = False):
        self.applied, self.fp16 = applied, fp16

    def was_step_applied(self) -> bool:
        return self.applied

    def fp16_enabled(self) -> bool:
        return self.fp16


def test_under_deepspeed_the_engines_verdict_is_the_gradient_flag():
    """The engine stepped inside backward: a step it skipped (inf/NaN gradients) is a skipped
    step; one it applied despite a NaN loss is not called skipped but counts toward the stop; an
    fp16 loss-scaler skip is the scaler's business, never a divergence."""
    finite = {"bad_loss": 0.0, "bad_grad": 0.0}
    guard = NonFiniteGuard(limit=2, world=2, engine=_Engine(applied=False))
    assert guard.check(1, finite, 2.0) is True and guard.consecutive == 1
    guard.engine = _Engine(applied=True)
    assert guard.check(2, {"bad_loss": 1.0}, float("nan")) is False
    assert guard.failure is not None and guard.failure.startswith("training diverged: 2 consec")
    scaler = NonFiniteGuard(limit=1, world=1, loss_scaler=True, engine=_Engine(False, fp16=True))
    assert scaler.check(1, finite, 2.0) is False and scaler.failure is None
