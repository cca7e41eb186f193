"""Bad input fails before training starts, with every problem named (row, field or key)."""

from __future__ import annotations

import json

import pytest
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.cli.main import main
from grimoire.errors import ConfigError, DataError
from grimoire.losses import SFTLoss


def _trainer(model, tokenizer, rows, tmp_path, **cfg):
    return GrimoireTrainer(
        model=model,
        tokenizer=tokenizer,
        loss_fn=SFTLoss(),
        train_dataset=rows,
        config=quiet_config(tmp_path, **cfg),
    )


def test_overlong_out_of_vocab_and_untrained_rows_are_all_named(
    tiny_model, tokenizer, sft_rows, tmp_path
):
    rows = [dict(r) for r in sft_rows[:6]]
    rows[1] = {"input_ids": [5] * 40, "labels": [5] * 40, "attention_mask": [1] * 40}
    rows[3] = {**rows[3], "input_ids": [*rows[3]["input_ids"][:-1], 999]}
    rows[4] = {**rows[4], "labels": [-100] * len(rows[4]["input_ids"])}
    with pytest.raises(DataError) as err:
        _trainer(tiny_model, tokenizer, rows, tmp_path, max_length=32)
    text = str(err.value)
    assert "train row 1: input_ids has 40 tokens > max_length=32" in text
    assert "train row 3: input_ids has token id 999 outside the model's vocabulary [0, 64)" in text
    assert "train row 4: labels has no trained token" in text
    assert len(err.value.problems) == 3
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_columns_named(tiny_model, tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"missing column\(s\) \['labels'\]"):
        _trainer(tiny_model, tokenizer, [{"input_ids": [1, 2, 3]}], tmp_path)


def test_token_budget_smaller_than_a_row(tiny_model, tokenizer, sft_rows, tmp_path):
    longest = max(range(len(sft_rows)), key=lambda i: len(sft_rows[i]["input_ids"]))
    n = len(sft_rows[longest]["input_ids"])
    with pytest.raises(
        DataError,
        match=rf"train row {longest}: needs {n} tokens in one forward pass .*"
        r"> max_tokens_per_device=8; set training.truncate_long_samples=true",
    ):
        _trainer(tiny_model, tokenizer, sft_rows, tmp_path, max_tokens_per_device=8)


def _yaml(tmp_path, data_rows, extra=""):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in data_rows))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
dataset: {{jsonl: "{data}", tokenize: {{type: sft, max_length: 64}}}}
training: {{output_dir: "{tmp_path / "out"}", max_steps: 1, progress_bar: false,
           gradient_checkpointing: false, mixed_precision: "no"}}
{extra}"""
    )
    return cfg


def test_cli_missing_field_and_empty_response_name_rows(tmp_path, capsys):
    rows = [{"prompt": "reverse abc=", "response": "cba"}] * 5
    rows = [dict(r) for r in rows]
    rows[2] = {"prompt": "reverse abc="}
    rows[4] = {"prompt": "reverse abc=", "response": ""}
    code = main(["train", "--config", str(_yaml(tmp_path, rows))])
    err = capsys.readouterr().err
    assert code != 0
    assert "row 2" in err and "'response'" in err
    assert "row 4" in err and "empty" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_cli_unknown_key_and_wrong_type_collected(tmp_path, capsys):
    rows = [{"prompt": "reverse abc=", "response": "cba"}]
    cfg = _yaml(tmp_path, rows, extra="lose: {type: sft}\n")
    code = main(
        [
            "train",
            "--config",
            str(cfg),
            "--set",
            "training.learning_rat=0.1",
            "--set",
            'training.batch_size="four"',
        ]
    )
    err = capsys.readouterr().err
    assert code != 0
    assert "lose" in err and 'did you mean "loss"' in err
    assert "training.learning_rat" in err and 'did you mean "learning_rate"' in err
    assert "batch_size must be int" in err


def test_config_collects_every_problem():
    from grimoire import TrainingConfig

    with pytest.raises(ConfigError) as err:
        TrainingConfig(
            batch_size=0,
            learning_rate="2e-5",
            warmup_ratio=1.5,
            lr_scheduler="cosin",
            mixed_precision="fp8",
            max_grad_norm=-1.0,
            osft_unfreeze_rank_ratio=2.0,
        )
    problems = err.value.problems
    assert len(problems) == 7
    joined = "\n".join(problems)
    assert 'did you mean "cosine"' in joined
    assert "learning_rate must be float, got str '2e-5'" in joined


def test_config_unknown_key_did_you_mean():
    from grimoire import TrainingConfig

    with pytest.raises(
        ConfigError, match='training.num_epoch: unknown key \\(did you mean "num_epochs"\\?\\)'
    ):
        TrainingConfig.from_dict({"num_epoch": 2})


def test_fp16_on_cpu_is_a_clear_error(tiny_model, tokenizer, sft_rows, tmp_path):
    with pytest.raises(ConfigError, match="fp16.*needs a CUDA GPU"):
        _trainer(tiny_model, tokenizer, sft_rows[:4], tmp_path, mixed_precision="fp16")


def test_bitsandbytes_optimizer_names_the_extra(tiny_model, tokenizer, sft_rows, tmp_path):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"grimoire\[quantization\]"):
            _trainer(tiny_model, tokenizer, sft_rows[:4], tmp_path, optimizer="adamw_8bit")
    else:  # pragma: no cover - only where bitsandbytes is installed
        _trainer(tiny_model, tokenizer, sft_rows[:4], tmp_path, optimizer="adamw_8bit")
