"""``log_with`` trackers really write: each test trains a few steps, then reads the tracker's
own files back with that tool's reader and finds the logged scalars at the steps and with the
values of ``metrics.jsonl`` (the trainer's independent record of the same run)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.helpers.train_utils import quiet_config, train

from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.training.metrics import init_trackers

STEPS = 3


def _records(output_dir: Path, split: str = "train") -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _run(tmp_path, tiny_model, tokenizer, sft_rows, **overrides):
    out = tmp_path / "out"
    config = quiet_config(out, max_steps=STEPS, project_name="proj", run_name="r1", **overrides)
    return out, train(tiny_model, tokenizer, sft_rows[:24], SFTLoss(), config)


def test_tensorboard_event_files_hold_loss_and_lr_at_each_step(
    tmp_path, tiny_model, tokenizer, sft_rows
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    config = quiet_config(
        out,
        max_steps=STEPS,
        log_with="tensorboard",
        project_name="proj",
        run_name="r1",
        eval_steps=2,
    )
    train(tiny_model, tokenizer, sft_rows[:24], SFTLoss(), config, eval_dataset=sft_rows[24:32])

    folder = out / "tensorboard" / "proj" / "r1"  # named from project_name / run_name
    acc = EventAccumulator(str(folder))
    acc.Reload()
    expected = _records(out)
    assert [r["step"] for r in expected] == [1, 2, 3]
    for key in ("loss", "lr", "tokens"):
        logged = {e.step: e.value for e in acc.Scalars(key)}
        assert logged == {r["step"]: pytest.approx(r[key], rel=1e-6) for r in expected}, key
    evals = _records(out, "eval")
    logged = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert logged == {r["step"]: pytest.approx(r["eval/loss"], rel=1e-6) for r in evals}
    assert sorted(logged) == [2, 3]  # eval_steps=2, and the final evaluation


def _wandb_records(path: Path):
    """The records of a ``.wandb`` transaction log, decoded with wandb's own protobuf schema.

    wandb >= 0.2x has no Python reader for offline runs (its Go core writes and syncs them), so
    the framing is undone here: a 7-byte ``:W&B`` header, then LevelDB log format (32 KiB
    blocks; each chunk ``crc32 u32, length u16, type u8``; FULL=1, FIRST=2, MIDDLE=3, LAST=4).
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a wandb transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the next block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_project_name_and_scalars(
    tmp_path, monkeypatch, tiny_model, tokenizer, sft_rows
):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    (tmp_path / "wandb-dir").mkdir()
    out, _ = _run(tmp_path, tiny_model, tokenizer, sft_rows, log_with="wandb")
    wandb.teardown()  # wandb-core writes the log asynchronously: stop it so the file is complete

    (log,) = (tmp_path / "wandb-dir").glob("wandb/offline-run-*/run-*.wandb")
    runs, history = [], {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            history[items["_step"]] = items
    assert [(r.project, r.display_name) for r in runs] == [("proj", "r1")]
    expected = _records(out)
    assert sorted(history) == [r["step"] for r in expected]
    for r in expected:
        for key in ("loss", "lr", "grad_norm", "tokens"):
            assert history[r["step"]][key] == pytest.approx(r[key], rel=1e-9), key


def test_mlflow_file_store_under_output_dir_holds_experiment_run_and_metrics(
    tmp_path, monkeypatch, tiny_model, tokenizer, sft_rows
):
    from mlflow.tracking import MlflowClient

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, _ = _run(tmp_path, tiny_model, tokenizer, sft_rows, log_with="mlflow")

    store = out / "mlruns"  # the default: a local store beside the run, not ./mlruns
    assert store.is_dir()
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1"
    assert run.data.params["learning_rate"] == "0.001"  # the config went in as parameters
    expected = _records(out)
    for key in ("loss", "lr", "tokens"):
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == {r["step"]: pytest.approx(r[key], rel=1e-9) for r in expected}, key


def test_a_tracker_whose_package_is_missing_is_an_error_not_a_silent_no_op(tmp_path):
    config = quiet_config(tmp_path, log_with=["tensorboard", "mlflow"])
    # What accelerate leaves in log_with when mlflow is not importable: it drops it silently.
    accelerator = SimpleNamespace(log_with=["tensorboard"], is_main_process=True)
    with pytest.raises(ConfigError) as info:
        init_trackers(accelerator, config)
    message = str(info.value)
    assert "log_with='mlflow'" in message and "pip install mlflow-skinny" in message
    assert "log_with='tensorboard'" not in message  # installed: not reported
