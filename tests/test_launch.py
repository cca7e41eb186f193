"""grimoire.launch: a torchrun job from Python, output streamed, failures raised with context."""

from __future__ import annotations

import io
import json

import pytest
from tests.helpers.train_utils import free_port

from grimoire import LaunchError, launch


def _config(tmp_path, data):
    return {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(data), "tokenize": {"type": "sft", "max_length": 64}},
        "training": {
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "batch_size": 2,
            "progress_bar": False,
            "gradient_checkpointing": False,
            "mixed_precision": "no",
            "save_on_epoch_end": False,
            "logging_steps": 1,
        },
    }


def test_launch_two_workers_streams_and_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"reverse {w}=", "response": w[::-1]}) + "\n"
            for w in ["abc", "bcd", "cde", "def", "efg", "fgh", "ghi", "hij"]
        )
    )
    sink = io.StringIO()
    code = launch(_config(tmp_path, data), nproc_per_node=2, master_port=free_port(), stream=sink)
    assert code == 0
    records = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [1, 2]
    # One data-parallel group, not two separate runs: 2 ranks x batch 2 = half of the 8 rows per
    # step (a lone process would be at epoch 0.25 after its first step).
    assert json.loads(records[0])["epoch"] == pytest.approx(0.5)
    assert (tmp_path / "out" / "launch.log").read_text() == sink.getvalue()


def test_launch_failure_raises_with_last_lines(tmp_path):
    cfg = _config(tmp_path, tmp_path / "missing.jsonl")
    with pytest.raises(LaunchError) as err:
        launch(cfg, nproc_per_node=1, master_port=free_port(), stream=None)
    assert err.value.returncode != 0
    assert "missing.jsonl" in "".join(err.value.last_lines)
