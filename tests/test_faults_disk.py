"""Faults met while saving and resuming, injected for real into ``grimoire train`` runs.

Each test ends with the proof that nothing was lost: the run resumed from the checkpoint the
fault left (``resume_from_checkpoint: latest``) reaches the same final weights as the same run
without the fault (6 steps, checkpoints every 2, a constant learning rate).

- a full disk: ``RLIMIT_FSIZE`` set after checkpoint-2 (writes fail with EFBIG) -> one message
  naming the path, the error and checkpoint-2; exit 1; no ``.tmp-checkpoint-4`` left behind;
- SIGKILL while checkpoint-4 is written -> ``latest`` is checkpoint-2 (the half checkpoint is
  never visible);
- a truncated or bit-flipped file in checkpoint-4 -> ``latest`` skips it and says so, naming
  the file; the same checkpoint named explicitly is refused, naming the file, before training
  (and by ``grimoire validate``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers.commands import grimoire_command, run
from tests.test_faults_nonfinite import _params, _run

from grimoire.model.tiny import reverse_rows, write_jsonl
from grimoire.training.checkpoint import resolve_resume_path
from grimoire.training.integrity import PREFIX, STATE_FILE, CheckpointDamaged, WriteFailed, damage
from grimoire.training.metrics import JsonlLogger
from grimoire.training.report import write_atomic

SPEC = "tests.scripts.fault_callbacks"


def _config(tmp_path: Path, name: str, callbacks=(), **training) -> Path:
    data = tmp_path / "train.jsonl"
    if not data.exists():
        write_jsonl(reverse_rows(64, seed=0), data)
    out = tmp_path / name
    settings = {
        "output_dir": str(out),
        "max_steps": 6,
        "batch_size": 4,
        "learning_rate": 3e-3,
        "lr_scheduler": "constant",
        "warmup_ratio": 0.0,
        "max_length": 64,
        "mixed_precision": "no",
        "gradient_checkpointing": False,
        "progress_bar": False,
        "save_on_epoch_end": False,
        "save_steps": 2,
        **training,
    }
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(data), "tokenize": {"type": "sft"}},
        "loss": {"type": "sft"},
        "training": settings,
        "callbacks": [{"type": f"{SPEC}:{cls}", "args": args} for cls, args in callbacks],
        "save_to": str(out / "final"),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def _train(tmp_path, config, *extra, expect=0):
    argv = [*grimoire_command(), "train", "--config", str(config), *extra]
    return run(argv, tmp_path, expect=expect)


def _resume(tmp_path, config):
    return _train(tmp_path, config, "--set", "training.resume_from_checkpoint=latest")


def uninterrupted_weights(tmp_path_factory) -> dict:
    """The final weights of the run without a fault. This file and tests/test_faults_signals.py
    read the same run: under pytest-xdist the first worker to need it trains it, holding a
    lock in the run's common temporary folder, and the other reads it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    tmp = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "faults-clean"
    final = tmp / "clean" / "final" / "model.safetensors"
    with FileLock(str(tmp) + ".lock"):
        if not final.is_file():
            tmp.mkdir(exist_ok=True)
            _train(tmp, _config(tmp, "clean"))
    return load_file(final)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_weights(tmp_path_factory)


def _same_as(final: Path, reference: dict) -> None:
    got = load_file(final / "model.safetensors")
    assert got.keys() == reference.keys()
    for k in got:
        assert (got[k] == reference[k]).all(), k


def _grimoire_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("grimoire train:")]


def test_a_full_disk_ends_in_one_message_and_the_earlier_checkpoint_resumes(
    tmp_path, uninterrupted
):
    limit = [("LimitFileSize", {"after_step": 2, "max_bytes": 100_000})]
    config = _config(tmp_path, "run", limit)
    done = _train(tmp_path, config, expect=1)
    (error,) = _grimoire_errors(done.stderr)
    out = tmp_path / "run"
    assert error.startswith(f"grimoire train: could not write checkpoint checkpoint-4 to {out}")
    assert (
        "File too large" in error and f"last complete checkpoint is {out / 'checkpoint-2'}" in error
    )
    assert "Traceback" not in done.stderr
    assert not (out / ".tmp-checkpoint-4").exists()
    assert not (out / "final").exists()
    _resume(tmp_path, _config(tmp_path, "run"))  # room again: the same run, without the limit
    _same_as(out / "final", uninterrupted)


def test_sigkill_during_a_save_leaves_the_earlier_checkpoint_as_latest(tmp_path, uninterrupted):
    config = _config(tmp_path, "run", [("KillDuringSave", {"step": 4})])
    done = _train(tmp_path, config, expect=-signal.SIGKILL)
    out = tmp_path / "run"
    assert (out / ".tmp-checkpoint-4").is_dir() and not (out / "checkpoint-4").exists()
    resumed = _resume(tmp_path, _config(tmp_path, "run"))
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr, done.stderr
    _same_as(out / "final", uninterrupted)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory) -> Path:
    """A run stopped after step 4 with checkpoints 2 and 4 (each test damages its own copy)."""
    tmp = tmp_path_factory.mktemp("stopped")
    _train(tmp, _config(tmp, "run", [("StopAt", {"step": 4})]))
    return tmp / "run"


@pytest.mark.parametrize("how", ["truncated", "bit-flipped"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path, uninterrupted, stopped_at_4, how
):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_4, out)
    shard = out / "checkpoint-4" / "dcp" / "__0_0.distcp"
    _damage(shard, how)
    clean = _config(tmp_path, "run")
    explicit = ["--set", f"training.resume_from_checkpoint={json.dumps(str(out / 'checkpoint-4'))}"]
    refused = run(
        [*grimoire_command(), "validate", "--config", str(clean), *explicit], tmp_path, expect=1
    )
    assert str(shard) in refused.stdout + refused.stderr
    refused = _train(tmp_path, clean, *explicit, expect=1)  # checked before the model loads
    assert refused.stderr.startswith("grimoire train: invalid configuration (1):\n")
    assert f"is damaged: {shard}" in refused.stderr
    assert f"the newest complete checkpoint beside it is {out / 'checkpoint-2'}" in refused.stderr
    resumed = _resume(tmp_path, clean)
    assert f"skipped the damaged checkpoint-4 ({shard}" in resumed.stderr
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    _same_as(out / "final", uninterrupted)


def test_a_damaged_fsdp2_shard_of_rank_1_falls_back_and_resumes_to_the_same_weights(
    tiny_dir, tmp_path
):
    """2 gloo processes, FSDP2: each rank writes its own DCP shard; rank 1's is truncated."""
    out = tmp_path / "run"
    settings = {"distributed": "fsdp2", "save_steps": 2}
    _run(tiny_dir, out, bad=[], processes=2, **settings)
    reference = _params(out, 0, 4)
    shard = out / "checkpoint-4" / "dcp" / "__1_0.distcp"
    assert shard.is_file()
    _damage(shard, "truncated")
    assert damage(out / "checkpoint-4").startswith(f"{shard} has ")
    with pytest.raises(CheckpointDamaged, match=f"is damaged: {shard} has"):
        resolve_resume_path(str(out / "checkpoint-4"), out)
    assert resolve_resume_path("latest", out) == out / "checkpoint-2"
    (out / "params_0_4.pt").unlink()
    _run(tiny_dir, out, bad=[], processes=2, resume_from_checkpoint="latest", **settings)
    resumed = _params(out, 0, 4)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_a_real_full_disk_on_a_small_tmpfs(tmp_path, uninterrupted):
    """The reported case: a tmpfs with room for one checkpoint (needs mount rights: root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test covers the fault)")
    try:
        config = _config(mnt, "run")
        done = _train(tmp_path, config, expect=1)
        (error,) = _grimoire_errors(done.stderr)
        out = mnt / "run"
        # Whichever writer meets the full disk: DCP's (errno 28) or torch.save's (short write).
        assert "No space left on device" in error or "a full disk" in error, error
        assert f"The last complete checkpoint is {out / 'checkpoint-2'}" in error
        assert not list(out.glob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_failed_metrics_and_summary_writes_name_the_path_and_the_last_checkpoint(tmp_path):
    """Both writers of a run's records: a file where the summary's folder should be,
    a folder where metrics.jsonl should be (EISDIR); the run's checkpoint-2 is named."""
    (tmp_path / f"{PREFIX}2").mkdir()
    (tmp_path / f"{PREFIX}2" / STATE_FILE).write_text("{}")
    blocker = tmp_path / "records"
    blocker.write_text("not a folder")
    summary = blocker / "run_summary.json"
    with pytest.raises(WriteFailed) as err:
        write_atomic(summary, "{}")
    assert str(err.value).startswith(f"could not write run_summary.json to {summary}: ")
    assert "FileExistsError" in str(err.value) or "NotADirectoryError" in str(err.value)
    path = tmp_path / "metrics.jsonl"
    path.mkdir()
    with pytest.raises(WriteFailed) as err:
        JsonlLogger(path, enabled=True).write({"step": 1})
    assert str(err.value).startswith(f"could not write metrics to {path}: IsADirectoryError")
    assert f"The last complete checkpoint is {tmp_path / 'checkpoint-2'}" in str(err.value)


def test_a_diverged_run_loses_nothing_its_last_good_checkpoint_resumes_to_the_same_weights(
    tmp_path, uninterrupted
):
    """The final norm returns NaN in steps 3-5 (a real non-finite forward): steps 3 and 4 are
    skipped (checkpoint-4 is written, holding only applied steps), step 5 is the third skip in a
    row and stops the run: exit 1, one message, no final model. checkpoint-2, the last written
    before the fault, resumed without it ends with the uninterrupted run's weights."""
    nan = [("NaNForward", {"steps": [3, 4, 5]})]
    done = _train(tmp_path, _config(tmp_path, "run", nan), expect=1)
    (error,) = _grimoire_errors(done.stderr)
    assert error.startswith("grimoire train: training diverged: 3 consecutive steps up to step 5")
    assert "the last finite loss was" in error and "at step 2" in error
    assert "Traceback" not in done.stderr
    out = tmp_path / "run"
    assert not (out / "final").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["skipped_steps"] == 3 and summary["steps"] == 5
    two = json.dumps(str(out / "checkpoint-2"))
    resumed = _train(
        tmp_path, _config(tmp_path, "run"), "--set", f"training.resume_from_checkpoint={two}"
    )
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    _same_as(out / "final", uninterrupted)
