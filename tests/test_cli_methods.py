"""Every method from YAML: preference data, a reference by path, by copy, reference caching."""

from __future__ import annotations

import json

import pytest

from grimoire.cli.main import main
from grimoire.cli.run import build_run
from grimoire.model.tiny import kto_rows, preference_rows


def _write(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _raw(tmp_path, data, loss):
    return {
        "model": {"pretrained": "tiny:llama", "model_kwargs": {"dtype": "float32"}},
        "dataset": {"jsonl": str(data)},
        "loss": loss,
        "training": {
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "batch_size": 4,
            "progress_bar": False,
            "gradient_checkpointing": False,
            "mixed_precision": "no",
            "save_on_epoch_end": False,
            "logging_steps": 1,
        },
    }


@pytest.mark.parametrize(
    "loss",
    [
        {"type": "dpo", "args": {"beta": 0.1}, "ref_model": "tiny:llama"},
        {"type": "dpo", "cache_reference": True},
        {"type": "ipo", "cache_reference": True},
        {"type": "simpo"},
        {"type": "cpo", "args": {"cpo_alpha": 0.5}},
        {"type": "orpo", "args": {"beta": 0.2}},
        {"type": "reward"},
    ],
    ids=["dpo-ref-path", "dpo-cached", "ipo-cached", "simpo", "cpo", "orpo", "reward"],
)
def test_pair_methods_train_from_yaml(tmp_path, loss):
    raw = _raw(tmp_path, _write(tmp_path, preference_rows(16, seed=0)), loss)
    run = build_run(raw)
    if loss.get("cache_reference"):
        assert "ref_chosen_logps" in run.trainer.train_dataset.column_names
    run.trainer.train()
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "rewards/accuracies" in records[-1]


def test_kto_from_yaml_with_cached_reference(tmp_path):
    raw = _raw(
        tmp_path, _write(tmp_path, kto_rows(16, seed=0)), {"type": "kto", "cache_reference": True}
    )
    run = build_run(raw)
    assert "ref_logps" in run.trainer.train_dataset.column_names
    run.trainer.train()
    assert run.trainer.global_step == 2


def test_ref_model_inside_args_is_rejected(tmp_path, capsys):
    raw = _raw(
        tmp_path,
        _write(tmp_path, preference_rows(4, seed=0)),
        {"type": "dpo", "args": {"ref_model": "x"}},
    )
    cfg = tmp_path / "run.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(raw))
    assert main(["validate", "--config", str(cfg)]) != 0
    assert "loss.ref_model" in capsys.readouterr().err


# RLOO's KL penalty and online DPO's scores need a reference; with neither LoRA nor a model
# path, the YAML asks for a frozen copy of the starting policy (ref_model: copy).
@pytest.mark.parametrize(
    ("method", "ref"), [("grpo", None), ("rloo", "copy"), ("online_dpo", "copy"), ("raft", None)]
)
def test_online_methods_train_from_yaml(tmp_path, method, ref):
    from grimoire.model.tiny import reverse_rows

    loss = {
        "type": method,
        "args": {"reward_funcs": ["char_match"], "num_generations": 4, "max_new_tokens": 6},
    }
    if ref is not None:
        loss["ref_model"] = ref
    raw = _raw(tmp_path, _write(tmp_path, reverse_rows(8, seed=0)), loss)
    raw["training"]["batch_size"] = 2
    run = build_run(raw)
    run.trainer.train()
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert any(k.startswith("rewards/") or k.startswith("reward") for k in records[-1])
