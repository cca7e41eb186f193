"""A grimoire-rl user switches by changing nothing (issue #14).

The Python and shell examples of grimoire-rl's README are kept verbatim in
``tests/reference_examples/grimoire_rl_readme.txt``; here they run against this library with only
model names and paths swapped for local tiny ones (each swap asserts its original text is still
in the block, so an edited copy fails loudly). grimoire-rl's documented YAML schema, every section
written out, is ``examples/grimoire_rl_schema.yaml``: it validates (bitsandbytes aside, which
needs CUDA) and trains and saves through ``grimoire train --config``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shlex
import warnings
from pathlib import Path

import pytest

from grimoire.cli.main import main
from grimoire.cli.schema import load_config, validate_config
from grimoire.model.tiny import preference_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = Path(__file__).parent / "reference_examples" / "grimoire_rl_readme.txt"
SCHEMA = ROOT / "examples" / "grimoire_rl_schema.yaml"
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
BNB_PROBLEM = "quantization: needs bitsandbytes"


def readme_blocks() -> dict[str, str]:
    blocks: dict[str, str] = {}
    name = None
    for line in EXAMPLES.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("#### "):
            name = line[5:].strip()
            blocks[name] = ""
        elif name is not None:
            blocks[name] += line
    return blocks


def swapped(block: str, swaps: dict[str, str]) -> str:
    for old, new in swaps.items():
        assert old in block, f"the README block no longer contains {old!r}"
        block = block.replace(old, new)
    return block


@pytest.fixture
def raw_sft_dataset():
    from datasets import Dataset

    rows = [{"prompt": f"reverse {w}=", "response": w[::-1]} for w in ("abc", "hello", "xyz", "qq")]
    return Dataset.from_list(rows * 2)


def test_readme_python_examples_run(tiny_dir, raw_sft_dataset, tmp_path, monkeypatch, capsys):
    from datasets import Dataset

    from grimoire.data import tokenize_preference

    monkeypatch.chdir(tmp_path)  # the examples write ./output and ./my-model
    blocks = readme_blocks()
    model_swap = {'"meta-llama/Llama-3-8B-Instruct"': repr(str(tiny_dir))}
    ns: dict = {"dataset": raw_sft_dataset}

    # SFT quick start: train, save, and the saved model loads.
    exec(swapped(blocks["sft"], model_swap), ns)
    sft_trainer = ns["trainer"]
    assert sft_trainer.global_step == 6  # 8 rows / batch 4 x 3 epochs
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    sft_dataset = ns["dataset"]

    # ORPO: the block maps `dataset` (raw preference rows) and trains on train_dataset /
    # eval_dataset, which the README assumes exist.
    tok = ns["tokenizer"]
    pref = Dataset.from_list(preference_rows(8, seed=0))
    tokenized = pref.map(
        lambda x: tokenize_preference(x, tok, max_length=2048), remove_columns=pref.column_names
    )
    ns.update(dataset=pref, train_dataset=tokenized, eval_dataset=tokenized.select(range(2)))
    exec(blocks["orpo"], ns)
    orpo = ns["trainer"]
    assert orpo.global_step == 8 and "log_odds_ratio" in json.dumps(
        [json.loads(x) for x in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    )

    # LoRA: `TrainingConfig(...)` is the README's placeholder for "your config".
    ns["dataset"] = sft_dataset
    exec(
        swapped(
            blocks["lora"],
            {"TrainingConfig(...)": "TrainingConfig(output_dir='./lora', num_epochs=1)"},
        ),
        ns,
    )
    lora = ns["trainer"]
    lora.train()
    assert type(lora.unwrapped_model).__name__.startswith("Peft")

    # Callbacks: `...` stands for the trainer's other arguments; should_stop() is the user's.
    calls = {"n": 0}

    def should_stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= 2

    ns["should_stop"] = should_stop
    args = (
        "model=model, tokenizer=tokenizer, loss_fn=SFTLoss(), train_dataset=dataset, "
        "eval_dataset=dataset, config=TrainingConfig(output_dir='./cb', num_epochs=3, "
        "batch_size=2, logging_steps=1, eval_steps=1)"
    )
    exec(swapped(blocks["callbacks"], {"GrimoireTrainer(...,": f"GrimoireTrainer({args},"}), ns)
    cb_trainer = ns["trainer"]
    cb_trainer.train()
    out = capsys.readouterr().out
    assert cb_trainer.stopped_early and cb_trainer.global_step == 2
    assert "Step 1/12:" in out and "Eval loss:" in out

    # The two loss sketches are pseudo-code (comments where the math goes): they must at least
    # be valid Python. The protocol they describe lacks loss_weight, which GrimoireTrainer
    # requires (docs/migrating-from-grimoire-rl.md lists the difference).
    for name in ("loss_interface", "dpo_sketch"):
        ast.parse(blocks[name])


def test_readme_yaml_cli_command_runs_verbatim(tmp_path, monkeypatch):
    """``python -m grimoire.train --config ... --set ... --set 'peft.target_modules=[...]'``."""
    monkeypatch.chdir(ROOT)
    lines = readme_blocks()["yaml_cli"]
    joined = lines.rstrip().split("\n\n")[-1].replace("\\\n", " ")
    command = next(line for line in joined.splitlines() if line and not line.startswith("#"))
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "grimoire.train"]
    argv = swapped_argv(argv[3:], {"configs/my.yaml": str(SCHEMA)})
    out = tmp_path / "run"
    argv += [
        "--set",
        f"training.output_dir={out}",
        "--set",
        f"save_to={out / 'final'}",
        "--set",
        "training.num_epochs=1",  # after the README's num_epochs=2: keep the test short
        *(["--set", "quantization=null"] if not HAS_BNB else []),
    ]
    assert main(argv) == 0
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]  # the README's override
    assert adapter["init_lora_weights"] == "gaussian" and adapter["r"] == 8
    from peft import AutoPeftModelForCausalLM

    AutoPeftModelForCausalLM.from_pretrained(out / "final")
    losses = [
        json.loads(x)["loss"]
        for x in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(x).get("split") == "train"
    ]
    assert losses and all(v == v for v in losses)


def swapped_argv(argv: list[str], swaps: dict[str, str]) -> list[str]:
    for old in swaps:
        assert old in argv, f"the README command no longer contains {old!r}"
    return [swaps.get(a, a) for a in argv]


def test_full_schema_validates_bitsandbytes_aside(monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = load_config(SCHEMA)
    assert set(raw) == {
        "model",
        "quantization",
        "dataset",
        "loss",
        "peft",
        "training",
        "save_to",
    }
    problems = validate_config(raw)
    if HAS_BNB:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(BNB_PROBLEM)
    # The CLI says so, with the extra to install, before loading anything.
    assert main(["validate", "--config", str(SCHEMA)]) == (0 if HAS_BNB else 1)


def test_full_schema_trains_and_saves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output_dir / save_to are relative in the example
    argv = ["train", "--config", str(SCHEMA), "--set", "training.max_steps=3"]
    if not HAS_BNB:
        argv += ["--set", "quantization=null"]
    assert main(argv) == 0
    final = tmp_path / "output" / "grimoire_rl_schema" / "final"
    assert (final / "adapter_config.json").is_file()
    assert (final / "tokenizer_config.json").is_file()


def test_earlier_spellings_warn_and_mean_the_same(tmp_path):
    from grimoire.cli.model import canonical_model

    old = {
        "model": {
            "name_or_path": "tiny:llama",
            "dtype": "bf16",
            "trust_remote_code": False,
            "attn_implementation": "eager",
            "quantization": {"load_in_8bit": True},
        }
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, problems = canonical_model(old)
    assert problems == []
    assert new == {
        "model": {
            "pretrained": "tiny:llama",
            "model_kwargs": {
                "dtype": "bf16",
                "trust_remote_code": False,
                "attn_implementation": "eager",
            },
            "tokenizer_kwargs": {"trust_remote_code": False},
        },
        "quantization": {"load_in_8bit": True},
    }
    assert old["model"]["name_or_path"] == "tiny:llama"  # the input is not modified
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(messages) == 5 and any("write model.pretrained" in m for m in messages)
    _, clash = canonical_model({"model": {"name_or_path": "a", "pretrained": "b"}})
    assert clash == [
        "model.name_or_path and model.pretrained are both given: keep only model.pretrained"
    ]


def test_model_kwargs_reach_from_pretrained_and_bad_ones_are_named(tiny_dir):
    import torch

    from grimoire.cli.model import from_pretrained_kwargs, load_model, model_problems

    cfg = {"pretrained": str(tiny_dir), "model_kwargs": {"torch_dtype": "bf16"}}
    assert from_pretrained_kwargs(cfg) == {"dtype": torch.bfloat16, "trust_remote_code": False}
    assert load_model(cfg, str(tiny_dir)).dtype == torch.bfloat16
    bad = {
        "pretrained": "x",
        "tokenizer_kwargs": {"trust_remote_code": "yes"},
        "model_kwargs": {"dtype": "bf61", "torch_dtype": "bf16", "device_map": "auto"},
    }
    problems = model_problems(bad, {"load_in_4bit": True, "bnb_4bit_quant_typ": "nf4"})
    joined = "\n".join(problems)
    assert "model.model_kwargs: give dtype or torch_dtype" in joined
    assert "model.model_kwargs.dtype: 'bf61' is not one of" in joined
    assert "model.model_kwargs.device_map: not accepted" in joined
    assert "model.tokenizer_kwargs.trust_remote_code: must be true or false" in joined
    assert 'quantization.bnb_4bit_quant_typ: unknown key (did you mean "bnb_4bit_quant_type"?)' in (
        joined
    )


def test_unknown_keys_list_the_valid_ones():
    problems = validate_config({"model": {"pretrained": "tiny:llama", "pretrianed": 1}})
    msg = next(p for p in problems if p.startswith("model.pretrianed"))
    assert msg.startswith('model.pretrianed: unknown key (did you mean "pretrained"?); valid keys:')
    assert "model_kwargs, tokenizer_kwargs" in msg


def test_peft_type_and_save_to_defaults(tmp_path, monkeypatch):
    from grimoire.cli.run import build_peft, save_path
    from grimoire.config.training import TrainingConfig

    assert build_peft({"type": "lora", "r": 4}).r == 4
    raw = {"model": {"pretrained": "tiny:llama"}, "dataset": {"jsonl": "x"}}
    assert any(
        p.startswith("peft.type: 'ia3' is not supported")
        for p in validate_config({**raw, "peft": {"type": "ia3"}})
    )
    cfg = TrainingConfig(output_dir=str(tmp_path))
    assert save_path({}, cfg) == str(tmp_path / "final")  # grimoire-rl's default
    assert save_path({"save_to": None}, cfg) == str(tmp_path / "final")
    assert save_path({"save_to": False}, cfg) is None
    assert save_path({"save_to": "elsewhere"}, cfg) == "elsewhere"
    assert any(p.startswith("save_to:") for p in validate_config({**raw, "save_to": True}))


def test_kto_label_column_end_to_end_from_yaml(tmp_path):
    """KTO rows carry ``label`` (bool), as in TRL and grimoire-rl, through tokenize, collate,
    the reference cache and the CLI."""
    rows = [
        {"prompt": f"reverse {w}=", "completion": c, "label": good}
        for w in ("abc", "hello", "xyz", "qq")
        for c, good in ((w[::-1], True), (w, False))
    ]
    data = write_jsonl(rows, tmp_path / "kto.jsonl")
    out = tmp_path / "out"
    config = tmp_path / "kto.yaml"
    config.write_text(
        f"model: {{pretrained: 'tiny:llama'}}\n"
        f"dataset: {{jsonl: {data}, tokenize: {{type: kto, max_length: 32}}}}\n"
        "loss: {type: kto, cache_reference: true}\n"
        f"training: {{output_dir: {out}, max_steps: 2, batch_size: 4, mixed_precision: 'no'}}\n"
        "save_to: false\n"
    )
    assert main(["train", "--config", str(config)]) == 0
    assert not (out / "final").exists()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2


def test_grimoire_rl_tokenize_arguments(tokenizer):
    from grimoire.data import tokenize_grpo, tokenize_kto, tokenize_sft

    row = {"prompt": "reverse abcdefgh=", "response": "hgfedcba"}
    full_prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
    out = tokenize_sft(row, tokenizer, max_length=64, max_prompt_length=5)
    n_prompt = out["labels"].count(-100)
    assert n_prompt == 5 and out["input_ids"][:5] == full_prompt[-5:]
    assert tokenize_sft(row, tokenizer)["input_ids"][: len(full_prompt)] == full_prompt

    # KTO rows written for grimoire-rl name the completion "response".
    rl_row = {"prompt": "reverse ab=", "response": "ba", "label": True}
    trl_row = {"prompt": "reverse ab=", "completion": "ba", "label": True}
    assert tokenize_kto(rl_row, tokenizer) == tokenize_kto(trl_row, tokenizer)
    assert tokenize_kto(
        {"prompt": "p=", "answer": "ba", "label": False}, tokenizer, response_field="answer"
    ) == tokenize_kto({"prompt": "p=", "completion": "ba", "label": False}, tokenizer)

    grpo_row = {"prompt": "reverse abcdefgh=", "answer": "hgfedcba", "noise": 1}
    cut = tokenize_grpo(grpo_row, tokenizer, max_prompt_length=4, metadata_fields=["answer"])
    assert cut["prompt_input_ids"] == full_prompt[-4:]
    assert cut["answer"] == "hgfedcba" and "noise" not in cut
    assert "noise" in tokenize_grpo(grpo_row, tokenizer)


def test_grimoire_rl_reward_functions_get_metadata():
    from grimoire.rollout.rewards.scoring import resolve_reward_funcs, score_completions

    seen = {}

    def rl_style(prompts, completions, metadata):  # grimoire-rl's reward signature
        seen["metadata"] = metadata
        return [float(c == m["answer"]) for c, m in zip(completions, metadata)]

    def ours(prompts, completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]

    cols = {"answer": ["ba", "cd"], "id": [1, 2]}
    funcs = resolve_reward_funcs([rl_style, ours])
    # metadata is built from the columns, so it is not a column the dataset must have.
    assert [f.required_columns() for f in funcs] == [[], ["answer"]]
    total, per = score_completions(funcs, ["p1", "p2"], ["ba", "xx"], cols)
    assert seen["metadata"] == [{"answer": "ba", "id": 1}, {"answer": "cd", "id": 2}]
    assert per["rl_style"].tolist() == per["ours"].tolist() == [1.0, 0.0]
    assert total.tolist() == [2.0, 0.0]


def test_grimoire_rl_loss_argument_names(tiny_dir, tokenizer):
    import torch
    from transformers import AutoModelForSequenceClassification

    from grimoire.data import tokenize_preference
    from grimoire.losses import KTOLoss, RAFTMethod, RewardModelLoss

    kto = KTOLoss(lambda_d=1.5, lambda_u=0.5)
    assert (kto.desirable_weight, kto.undesirable_weight) == (1.5, 0.5)
    with pytest.raises(ValueError, match="not both"):
        KTOLoss(lambda_d=1.5, desirable_weight=2.0)
    assert RAFTMethod("exact_match", min_reward=0.5).reward_threshold == 0.5

    # RewardModelLoss(margin=m) is the per-pair margin column filled with m everywhere (that
    # path's math is checked against a naive reference in tests/losses).
    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, seed=1)]
    batch = RewardModelLoss().create_collator(tokenizer.pad_token_id)(rows)
    constant, _ = RewardModelLoss(margin=0.7)(model, batch, training=False)
    column, _ = RewardModelLoss(margin_field="m")(
        model, {**batch, "m": torch.full((4,), 0.7)}, training=False
    )
    none, _ = RewardModelLoss()(model, batch, training=False)
    assert torch.allclose(constant, column) and constant > none
    with pytest.raises(ValueError, match="not both"):
        RewardModelLoss(margin_field="m", margin=1.0)


def test_set_with_an_unquoted_list_is_an_error_not_a_string():
    from grimoire.cli.schema import parse_override
    from grimoire.errors import ConfigError

    assert parse_override('peft.target_modules=["q_proj","v_proj"]')[1] == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_override("peft.target_modules=[q_proj,v_proj]")
    assert parse_override("training.run_name=my-run")[1] == "my-run"
