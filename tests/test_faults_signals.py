"""Real signals sent to a running ``grimoire train`` (a subprocess, as a user's shell does).

- Ctrl-C (SIGINT) once: the run stops at the step boundary with a checkpoint, prints ONE
  message naming it and the resume command, no traceback, and exits 130 (not 0: ``&&`` and
  schedulers see it); resumed, it says which checkpoint and step it continues from, and ends
  with the same weights as the uninterrupted run.
- Ctrl-C twice: aborts at once, one line, no traceback, exit 130; the periodic checkpoint
  before it resumes to the same weights.
- SIGTERM: one message (it used to print twice), exit 143; resumes to the same weights.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from tests.helpers.commands import command_env, grimoire_command
from tests.test_faults_disk import _config, _resume, _same_as, uninterrupted_weights


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_weights(tmp_path_factory)


def _start(tmp_path, seconds: float, save_steps: int = 100, wait_for: str | None = None):
    """``grimoire train`` started, returned once its first step is logged (and ``wait_for``,
    a checkpoint folder name, exists)."""
    config = _config(
        tmp_path,
        "run",
        [("SlowSteps", {"seconds": seconds})],
        save_steps=save_steps,
        logging_steps=1,
    )
    argv = [*grimoire_command(), "train", "--config", str(config)]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    ready = tmp_path / "run" / wait_for if wait_for else metrics
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1 and ready.exists()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def _finish(proc):
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_ctrl_c_checkpoints_at_the_step_boundary_and_resumes_to_the_same_weights(
    tmp_path, uninterrupted
):
    proc = _start(tmp_path, seconds=1.0)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code == 130, err
    assert "Traceback" not in err
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIGINT")]
    assert len(stops) == 1, err
    step = int(stops[0].split("after step ")[1].split(";")[0])
    out = tmp_path / "run"
    assert stops[0] == (
        f"stopped by SIGINT after step {step}; checkpoint: {out / f'checkpoint-{step}'}. Resume "
        "with resume_from_checkpoint='latest' and the same output_dir (CLI: the same command "
        "plus --set training.resume_from_checkpoint=latest)."
    )
    assert 1 <= step < 6 and not (out / "final").exists()
    resumed = _resume(tmp_path, _config(tmp_path, "run", save_steps=100, logging_steps=1))
    assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in resumed.stderr
    _same_as(out / "final", uninterrupted)


def test_a_second_ctrl_c_aborts_at_once_and_the_earlier_checkpoint_resumes(tmp_path, uninterrupted):
    """Two Ctrl-C after the periodic checkpoint-2: abort without a checkpoint of its own; the
    run resumed from checkpoint-2 ends with the uninterrupted run's weights."""
    proc = _start(tmp_path, seconds=5.0, save_steps=2, wait_for="checkpoint-2")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code == 130, err
    assert "Traceback" not in err
    assert "grimoire train: interrupted twice: aborted at once, without a checkpoint" in err
    out = tmp_path / "run"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "final").exists()
    resumed = _resume(tmp_path, _config(tmp_path, "run", logging_steps=1))
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    _same_as(out / "final", uninterrupted)


def test_sigterm_prints_its_message_once_exits_143_and_resumes_to_the_same_weights(
    tmp_path, uninterrupted
):
    proc = _start(tmp_path, seconds=1.0)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 143, err
    stops = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 1, err
    assert "Traceback" not in err
    step = int(stops[0].split("after step ")[1].split(";")[0])
    out = tmp_path / "run"
    resumed = _resume(tmp_path, _config(tmp_path, "run", save_steps=100, logging_steps=1))
    assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in resumed.stderr
    _same_as(out / "final", uninterrupted)
