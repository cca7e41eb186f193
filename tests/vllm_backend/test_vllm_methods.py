"""Every online method trains from YAML with ``loss.args.engine: vllm`` (the ``grimoire train``
command, ``--set`` included), with the importance-sampling correction logged by the
policy-gradient ones; an engine mapping passes vLLM settings through."""

from __future__ import annotations

import json

import pytest
import yaml

from grimoire.cli.main import main

STEPS = 2


def _config(tmp_path, vllm_tiny, loss) -> str:
    raw = {
        "model": {"pretrained": str(vllm_tiny), "model_kwargs": {"dtype": "float32"}},
        "dataset": {"jsonl": "grimoire://assets/reverse_train.jsonl"},
        "loss": loss,
        "training": {
            "output_dir": str(tmp_path / "out"),
            "max_steps": STEPS,
            "batch_size": 2,
            "learning_rate": 1e-3,
            "lr_scheduler": "constant",
            "max_length": 64,
            "progress_bar": False,
            "gradient_checkpointing": False,
            "mixed_precision": "no",
            "save_on_epoch_end": False,
            "disable_dropout": True,
            "logging_steps": 1,
        },
        "save_to": False,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


ARGS = {"reward_funcs": ["char_match"], "max_new_tokens": 8}


@pytest.mark.parametrize(
    "loss, corrected",
    [
        ({"type": "grpo", "args": {**ARGS, "num_generations": 4}}, True),
        ({"type": "rloo", "args": {**ARGS, "num_generations": 4, "beta": 0.0}}, True),
        (
            {"type": "online_dpo", "args": {**ARGS, "num_generations": 4}, "ref_model": "copy"},
            False,
        ),
        ({"type": "raft", "args": {**ARGS, "num_generations": 4}}, False),
    ],
    ids=["grpo", "rloo", "online_dpo", "raft"],
)
def test_online_methods_train_with_engine_vllm_from_yaml(tmp_path, vllm_tiny, loss, corrected):
    config = _config(tmp_path, vllm_tiny, loss)
    assert main(["train", "--config", config, "--set", "loss.args.engine=vllm"]) == 0
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if json.loads(x)["split"] == "train"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all("rewards/mean" in r for r in records)
    # (A step whose micro-batches train nothing, e.g. Online DPO with only ties, logs zeros.)
    assert max(r["time/generation"] for r in records) > 0
    logged = "sampling/importance_sampling_ratio/mean" in records[0]
    assert logged == corrected  # a correction only where the loss is a policy gradient
    if corrected:  # fp32 sampler and learner: the weights are 1
        assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in records)


def test_an_engine_mapping_passes_vllm_settings(tmp_path, vllm_tiny):
    engine = {"type": "vllm", "args": {"max_model_len": 48, "importance_sampling": False}}
    loss = {"type": "grpo", "args": {**ARGS, "num_generations": 2, "engine": engine}}
    assert main(["train", "--config", _config(tmp_path, vllm_tiny, loss)]) == 0
    first = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/mean" in first
    assert "sampling/importance_sampling_ratio/mean" not in first  # switched off


def test_validate_reports_a_bad_engine_mapping_before_loading_anything(tmp_path, vllm_tiny, capsys):
    engine = {"type": "vllm", "args": {"top_p": 0.9, "gpu_memory": 0.5}}
    loss = {"type": "grpo", "args": {**ARGS, "engine": engine}}
    assert main(["validate", "--config", _config(tmp_path, vllm_tiny, loss)]) == 1
    err = capsys.readouterr().err
    assert "loss.args.engine.args.top_p: a sampling setting" in err
    assert "loss.args.engine.args.gpu_memory: unknown vllm engine argument" in err
