"""The ``grimoire train`` CLI: YAML parsing, --set, validation, mini_trainer flags, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grimoire.cli.main import check_config, config_from_args, main, parse_args, sparkline, summarize
from grimoire.cli.schema import (
    DEFAULT_CONFIG,
    apply_mini_trainer_flags,
    apply_overrides,
    load_config,
    parse_override,
    parse_yaml,
    validate_config,
)
from grimoire.compat.mini_trainer import MINI_TRAINER_FLAGS, markdown_table
from grimoire.errors import ConfigError
from grimoire.model.tiny import reverse_rows, write_jsonl
from grimoire.rows.sources import PACKAGE_ROOT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture
def data(tmp_path):
    train = write_jsonl(reverse_rows(32, seed=0), tmp_path / "train.jsonl")
    evals = write_jsonl(reverse_rows(8, seed=1), tmp_path / "eval.jsonl")
    return train, evals


def minimal(train, evals=None, **training):
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(train), "tokenize": {"type": "sft"}},
        "loss": {"type": "sft"},
        "training": {"max_steps": 5, "batch_size": 8, "max_length": 64, **training},
    }
    if evals is not None:
        raw["eval_dataset"] = {"jsonl": str(evals)}
    return raw


# --------------------------------------------------------------------------- YAML


def test_yaml_reads_exponent_floats_and_keeps_quoted_strings():
    cfg = parse_yaml("a: 2e-5\nb: 1E3\nc: -3.5e+2\nd: '2e-5'\ne: 1_000\nf: 1.0\ng: .5\nh: 7\n")
    assert cfg == {
        "a": 2e-5,
        "b": 1000.0,
        "c": -350.0,
        "d": "2e-5",
        "e": 1000,
        "f": 1.0,
        "g": 0.5,
        "h": 7,
    }
    assert isinstance(cfg["a"], float) and isinstance(cfg["h"], int)


def test_yaml_is_safe_and_rejects_duplicates_and_non_mappings():
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_yaml("a: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        parse_yaml("lr: 1\nlr: 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_yaml("- 1\n- 2\n")


# --------------------------------------------------------------------------- --set


@pytest.mark.parametrize(
    ("item", "value"),
    [
        ("training.learning_rate=2e-5", 2e-5),
        ("training.batch_size=8", 8),
        ('peft.target_modules=["q_proj","v_proj"]', ["q_proj", "v_proj"]),
        ("training.run_name=my-run", "my-run"),  # not JSON: kept as the raw string
        ('training.run_name="7"', "7"),  # JSON string: a way to force a string
        ("training.max_steps=null", None),
        ("training.osft=true", True),
        ("a.b=x=y", "x=y"),  # only the first = splits
    ],
)
def test_set_values_are_json_decoded(item, value):
    parts, got = parse_override(item)
    assert got == value and type(got) is type(value)
    assert parts == item.split("=", 1)[0].split(".")


def test_set_creates_nested_keys_and_overrides_without_mutating():
    raw = {"training": {"batch_size": 4}, "peft": None}
    out = apply_overrides(raw, ["training.batch_size=16", "peft.r=8", "new.deep.key=[1, 2]"])
    assert out == {
        "training": {"batch_size": 16},
        "peft": {"r": 8},
        "new": {"deep": {"key": [1, 2]}},
    }
    assert raw == {"training": {"batch_size": 4}, "peft": None}


def test_set_errors_are_collected():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"save_to": "x"}, ["save_to.deeper=1", "no_equals", "a..b=1"])
    assert len(info.value.problems) == 3
    assert "save_to is a str, not a mapping" in info.value.problems[0]


# --------------------------------------------------------------------------- validation


def test_unknown_keys_everywhere_in_one_error(data):
    train, evals = data
    raw = minimal(train, evals, learning_rat=1e-3)
    raw["modle"] = {}
    raw["model"]["tokeniser"] = "x"
    raw["dataset"]["max_sample"] = 3
    raw["dataset"]["tokenize"]["prompt_fild"] = "q"
    raw["loss"]["args"] = {"fused_chunk": 1}
    raw["peft"] = {"r": 8, "lora_alpah": 16}
    raw["callbacks"] = [{"type": "exact_match", "args": {"max_new_token": 4}}]
    with pytest.raises(ConfigError) as info:
        check_config(raw)
    msg = str(info.value)
    for dotted, hint in [
        ("modle", "model"),
        ("model.tokeniser", "tokenizer"),
        ("training.learning_rat", "learning_rate"),
        ("dataset.max_sample", "max_samples"),
        ("dataset.tokenize.prompt_fild", "prompt_field"),
        ("loss.args.fused_chunk", "fused_chunk_size"),
        ("peft.lora_alpah", "lora_alpha"),
        ("callbacks[0].args.max_new_token", "max_new_tokens"),
    ]:
        assert f'{dotted}: unknown key (did you mean "{hint}"?)' in msg, dotted
    assert len(info.value.problems) == 8


def test_wrong_types_and_values_are_reported(data):
    train, _ = data
    raw = minimal(train, batch_size="8", lr_scheduler="cosin")
    raw["model"]["model_kwargs"] = {"dtype": "fp61"}
    raw["loss"] = {"type": "sfft"}
    problems = validate_config(raw)
    joined = "\n".join(problems)
    assert "training.batch_size must be int, got str '8'" in joined
    assert "training.lr_scheduler='cosin'" in joined and 'did you mean "cosine"' in joined
    assert "model.model_kwargs.dtype: 'fp61' is not one of" in joined
    assert "loss.type: unknown name 'sfft'" in joined


def test_required_sections_and_callback_rows(data, tmp_path):
    problems = validate_config({"training": {}})
    assert any(p.startswith("model.pretrained: required") for p in problems)
    assert any(p.startswith("dataset: required") for p in problems)
    train, _ = data
    raw = minimal(train)
    raw["callbacks"] = [{"type": "exact_match"}]  # no eval_dataset to default rows from
    assert any("callbacks[0].args.rows: required" in p for p in validate_config(raw))
    raw["callbacks"] = [
        {
            "type": "exact_match",
            "args": {"rows": {"dataset": {"jsonl": str(tmp_path / "no.jsonl")}}},
        }
    ]
    assert any(
        p.startswith("callbacks[0].args.rows.dataset.jsonl: file not found")
        for p in validate_config(raw)
    )
    raw["model"]["pretrained"] = "tiny:lama"
    assert any(
        "unknown tiny architecture 'lama' (did you mean \"llama\"?)" in p
        for p in validate_config(raw)
    )


def test_valid_minimal_config_passes(data):
    train, evals = data
    raw = minimal(train, evals)
    raw["callbacks"] = [{"type": "exact_match", "args": {"max_new_tokens": 4}}]
    assert validate_config(raw) == []
    assert check_config(raw).batch_size == 8
    # Empty YAML sections (`loss:` parses as None) mean "absent", not a crash.
    assert validate_config({**raw, "loss": None, "peft": None, "callbacks": None}) == []
    assert check_config({**raw, "training": None}).max_steps is None


def test_quantization_without_bitsandbytes_names_the_extra(data, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real(name, *a),
    )
    raw = minimal(data[0])
    raw["model"]["quantization"] = {"load_in_4bit": True}
    assert any("grimoire[quantization]" in p for p in validate_config(raw))


def test_shipped_configs_validate_and_match():
    assets = PACKAGE_ROOT / "assets"
    missing = [
        n for n in ("reverse_train.jsonl", "reverse_eval.jsonl") if not (assets / n).is_file()
    ]
    assert not missing, f"bundled assets {missing} missing: run `python -m grimoire.model.tiny`"
    for path in (EXAMPLE, DEFAULT_CONFIG):
        assert main(["validate", "--config", str(path)]) == 0, path
    assert main(["--dry-run"]) == 0  # no --config: the embedded default
    assert load_config(EXAMPLE) == load_config(None) == load_config(DEFAULT_CONFIG)
    assert load_config(None)["training"]["learning_rate"] == 1.5e-3


def test_validate_command_exits_1_and_lists_problems(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {pretrained: tiny:llama}\ntraining: {learnin_rate: 1}\n")
    assert main(["validate", "--config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "training.learnin_rate: unknown key" in err and "dataset: required" in err


# --------------------------------------------------------------------------- commands and flags


def test_command_word_is_optional():
    assert parse_args(["train", "--config", "x.yaml"])[0] == "train"
    assert parse_args(["--config", "x.yaml"])[0] == "train"
    assert parse_args(["validate", "--config", "x.yaml"])[0] == "validate"
    assert parse_args(["train", "--dry-run"])[0] == "validate"


def test_mini_trainer_flags_map_onto_the_schema(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _, args = parse_args(
        [
            "--model-name-or-path",
            "m/M",
            "--data-path",
            "d.jsonl",
            "--output-dir",
            "out",
            "--batch-size",
            "128",
            "--max-tokens-per-gpu",
            "4096",
            "--learning-rate",
            "5e-6",
            "--num-warmup-steps",
            "10",
            "--lr-scheduler",
            "constant_with_warmup",
            "--seed",
            "7",
            "--max-epochs",
            "2",
            "--max-steps",
            "0",
            "--use-liger-kernels",
            "--osft",
            "--osft-unfreeze-rank-ratio",
            "0.3",
            "--save-final-checkpoint",
            "--checkpoint-at-epoch",
            "--wandb-project",
            "proj",
            "--wandb-entity",
            "team",
            "--wandb-run-name",
            "r1",
            "--set",
            "training.logging_steps=5",
        ]
    )
    raw = config_from_args(args)
    assert raw["model"] == {"pretrained": "m/M"}
    assert raw["dataset"] == {"jsonl": "d.jsonl", "tokenize": {"type": "pretokenized"}}
    assert raw["loss"] == {"type": "sft"}
    assert raw["save_to"] == str(Path("out") / "final")
    assert raw["wandb"] == {"project": "proj", "entity": "team"}
    assert raw["training"] == {
        "num_epochs": 2,
        "save_on_epoch_end": True,
        "warmup_ratio": 0.0,
        "output_dir": "out",
        "max_tokens_per_device": 4096,
        "learning_rate": 5e-6,
        "warmup_steps": 10,
        "lr_scheduler": "constant_with_warmup",
        "seed": 7,
        "use_liger": True,
        "osft": True,
        "osft_unfreeze_rank_ratio": 0.3,
        "run_name": "r1",
        "max_steps": None,
        "log_with": "wandb",
        "batch_size": 64,
        "logging_steps": 5,
    }


def test_global_batch_splits_over_ranks_and_accumulation(data):
    raw = {"training": {"gradient_accumulation_steps": 4}}
    out = apply_mini_trainer_flags(raw, {"batch_size": 128}, world_size=8)
    assert out["training"]["batch_size"] == 4  # 4 per device x 4 accumulation x 8 ranks = 128
    with pytest.raises(ConfigError, match="not divisible"):
        apply_mini_trainer_flags(raw, {"batch_size": 100}, world_size=8)
    # Flags override the YAML, --set overrides flags.
    yaml_file = data[0].parent / "c.yaml"
    yaml_file.write_text("training: {learning_rate: 1e-3, seed: 1}\n")
    _, args = parse_args(
        [
            "--config",
            str(yaml_file),
            "--learning-rate",
            "2e-4",
            "--seed",
            "3",
            "--set",
            "training.seed=9",
        ]
    )
    assert config_from_args(args)["training"] == {"learning_rate": 2e-4, "seed": 9}


def test_docs_flag_table_is_the_code_table():
    # One list of mini_trainer flags (grimoire.compat.mini_trainer): the parser is built from it,
    # and the table in docs/cli.md must be its rendering, row for row.
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = doc[doc.index("| flag | becomes |") :].split("\n\n", 1)[0].strip()
    assert block == markdown_table(), (
        "docs/cli.md's mini_trainer flag table differs from "
        "grimoire.compat.mini_trainer.MINI_TRAINER_FLAGS; replace it with the output of "
        "grimoire.compat.mini_trainer.markdown_table()"
    )


@pytest.mark.parametrize("flag", MINI_TRAINER_FLAGS, ids=lambda f: f.flag)
def test_every_table_flag_parses_and_changes_the_config(flag):
    value = {bool: [], int: ["8"], float: ["0.5"], str: ["x"]}[flag.kind]
    _, args = parse_args([flag.flag, *value])
    given = getattr(args, flag.dest)
    assert given is not None
    assert apply_mini_trainer_flags({}, {flag.dest: given}, world_size=1) != {}


# --------------------------------------------------------------------------- loss.ref_model


class RecordingLoss:
    """A stand-in method (``loss.type: tests.test_cli:RecordingLoss``) that keeps its arguments;
    its core is there for the contract's check, never called (the trainer is stubbed)."""

    def __init__(self, ref_model=None):
        self.ref_model = ref_model

    def __call__(self, model, batch, training=True):
        raise NotImplementedError

    def create_collator(self, pad_token_id):
        raise NotImplementedError

    def loss_weight(self, batch):
        raise NotImplementedError


@pytest.mark.parametrize("cache", [False, True])
def test_ref_model_copy_reaches_the_loss_as_the_string_copy(data, tmp_path, monkeypatch, cache):
    from grimoire.cli import run as train_cli

    raw = minimal(data[0], output_dir=str(tmp_path / "out"))
    raw["loss"] = {"type": "tests.test_cli:RecordingLoss", "ref_model": "copy"}
    assert validate_config(raw) == []
    assert validate_config({**raw, "loss": {"type": "dpo", "ref_model": "copy"}}) == []
    loaded: list[str] = []
    monkeypatch.setattr(
        train_cli,
        "load_model",
        lambda cfg, path, kind="causal_lm", quant=None, **_: loaded.append(path) or path,
    )
    monkeypatch.setattr(train_cli, "GrimoireTrainer", lambda **kwargs: kwargs)
    if cache:
        # Caching from "a copy of the starting policy" is caching from the starting policy.
        raw["loss"]["cache_reference"] = True
        monkeypatch.setattr(train_cli, "cache_reference", lambda ref, ds, loss, cfg, where: ref)
    run = train_cli.build_run(raw)
    policy_path = str(tmp_path / "out" / "tiny-model")
    if cache:
        assert run.trainer["loss_fn"].ref_model is None
        assert run.trainer["train_dataset"] == policy_path  # cached with the starting policy
        assert loaded == [policy_path, policy_path]
    else:
        assert run.trainer["loss_fn"].ref_model == "copy"
        assert loaded == [policy_path]  # the policy only: nothing is loaded from a path "copy"


# --------------------------------------------------------------------------- summary and e2e


def test_summary_reads_metrics(tmp_path):
    records = [{"split": "train", "step": s, "loss": 3.0 - s / 10} for s in range(1, 11)]
    records.append({"split": "eval", "step": 10, "eval/loss": 1.5, "eval/exact_match": 0.25})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = summarize(tmp_path, "somewhere/final")
    assert "2.9000 -> 2.0000" in text and "held-out exact match: 25.0%" in text
    assert "model saved to: somewhere/final" in text
    assert sparkline([3, 2, 1]) == "@=_" and sparkline([]) == ""
    # An evaluation before training (eval_on_start) is shown as the starting point.
    records.insert(0, {"split": "eval", "step": 0, "eval/loss": 2.5, "eval/exact_match": 0.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "held-out exact match: 0.0% at step 0 -> 25.0%" in summarize(tmp_path, None)


@pytest.mark.slow
def test_end_to_end_tiny_run(tmp_path, data, capsys):
    from transformers import AutoModelForCausalLM

    train, evals = data
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
dataset: {{jsonl: {train}, tokenize: {{type: sft}}}}
eval_dataset: {{jsonl: {evals}}}
loss: {{type: sft}}
training:
  output_dir: {out}
  max_steps: 5
  batch_size: 8
  learning_rate: 3e-3
  max_length: 64
  mixed_precision: "no"
  gradient_checkpointing: false
  logging_steps: 1
  save_on_epoch_end: false
callbacks:
  - {{type: exact_match, args: {{max_new_tokens: 4}}}}
save_to: {out / "final"}
"""
    )
    assert main(["train", "--config", str(config), "--set", "training.progress_bar=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r.get("split") == "train"]
    assert len(train_losses) == 5 and train_losses[-1] < train_losses[0]
    assert any("eval/exact_match" in r for r in records)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "llama"
    printed = capsys.readouterr().out
    assert "held-out exact match" in printed and str(out / "final") in printed
