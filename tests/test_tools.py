"""``grimoire merge-lora`` and ``grimoire generate`` on the tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire.cli.main import main as cli

INPUT = torch.tensor([[1, 20, 21, 22, 23, 24, 25, 26]])


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_dir, tokenizer, sft_rows):
    """A LoRA adapter trained a few steps, saved the way a run saves it."""
    from peft import LoraConfig
    from tests.helpers.train_utils import quiet_config, train

    from grimoire.losses import SFTLoss

    out = tmp_path_factory.mktemp("lora")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    # A large learning rate so B moves far from its zero init and the merge visibly matters.
    config = quiet_config(out / "run", max_steps=3, learning_rate=5e-2)
    trainer = train(model, tokenizer, sft_rows, SFTLoss(), config, peft_config=lora)
    trainer.save_model(out / "adapter")
    return out / "adapter"


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def test_merge_lora_equals_the_peft_model(adapter_dir, tiny_dir, tmp_path, capsys):
    from peft import PeftModel

    assert json.loads((adapter_dir / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(tiny_dir)
    out = tmp_path / "merged"
    assert cli(["merge-lora", "--adapter", str(adapter_dir), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert not (out / "adapter_config.json").exists()  # a plain model, no peft needed

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir), str(adapter_dir)
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    expected = logits_of(peft_model)
    torch.testing.assert_close(logits_of(merged), expected, atol=1e-5, rtol=1e-5)
    assert (logits_of(base) - expected).abs().max() > 1e-2  # the adapter changed the model
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("abc")["input_ids"] == AutoTokenizer.from_pretrained(tiny_dir)("abc")["input_ids"]


def test_merge_lora_base_override(adapter_dir, tiny_dir, tmp_path, capsys):
    from peft import PeftModel

    # The base moved since training: the recorded path is gone, --base points at the new place.
    moved_adapter, moved_base = tmp_path / "adapter", tmp_path / "base"
    shutil.copytree(adapter_dir, moved_adapter)
    shutil.copytree(tiny_dir, moved_base)
    cfg = json.loads((moved_adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved_adapter / "adapter_config.json").write_text(json.dumps(cfg))
    args = ["merge-lora", "--adapter", str(moved_adapter)]
    assert cli([*args, "--out", str(tmp_path / "m1")]) == 1  # the recorded base is missing
    err = capsys.readouterr().err
    assert f"cannot load model '{tmp_path / 'gone'}'" in err and "--base" in err
    assert cli([*args, "--out", str(tmp_path / "m2"), "--base", str(moved_base)]) == 0
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir), str(adapter_dir)
    ).eval()
    torch.testing.assert_close(
        logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "m2")),
        logits_of(peft_model),
        atol=1e-5,
        rtol=1e-5,
    )


def test_merge_lora_errors(tiny_dir, adapter_dir, tmp_path, capsys):
    assert cli(["merge-lora", "--adapter", str(tiny_dir), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire merge-lora: ")
    assert f"{tiny_dir}/adapter_config.json not found" in err
    assert "full model (config.json): use it directly" in err

    assert cli(["merge-lora", "--adapter", str(tmp_path / "nope"), "--out", "o"]) == 1
    assert "no such directory" in capsys.readouterr().err

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    args = ["merge-lora", "--adapter", str(adapter_dir), "--out", str(tmp_path / "full")]
    assert cli(args) == 1
    assert "exists and is not empty" in capsys.readouterr().err

    assert cli(["merge-lora", "--out", "o"]) == 1
    assert "--adapter" in capsys.readouterr().err


def naive_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Argmax over the full-sequence logits, one token at a time: no cache, no generate()."""
    ids = tokenizer(prompt)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_generate_greedy_matches_a_naive_argmax_loop(adapter_dir, tiny_dir, tmp_path, capsys):
    from peft import PeftModel

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (
        cli(
            [
                "generate",
                "--model",
                str(tiny_dir),
                "--prompt",
                "reverse abc=",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    expected = naive_greedy(
        AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), tok, "reverse abc=", 12
    )
    assert expected  # a non-empty completion, so the comparison means something
    assert capsys.readouterr().out == expected + "\n"

    # An adapter folder works directly (loaded onto its base).
    assert (
        cli(
            [
                "generate",
                "--model",
                str(adapter_dir),
                "--prompt",
                "reverse abc=",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir), str(adapter_dir)
    ).eval()
    assert capsys.readouterr().out == naive_greedy(peft_model, tok, "reverse abc=", 12) + "\n"


def test_generate_chat_template(tiny_dir, tmp_path, capsys):
    args = ["generate", "--prompt", "hi", "--chat", "--max-new-tokens", "4"]
    assert cli([*args, "--model", str(tiny_dir)]) == 0  # the tiny tokenizer has a template
    no_template = tmp_path / "plain"
    shutil.copytree(tiny_dir, no_template)
    tok = AutoTokenizer.from_pretrained(no_template)
    tok.chat_template = None
    tok.save_pretrained(no_template)
    for name in ("chat_template.jinja", "chat_template.json"):
        (no_template / name).unlink(missing_ok=True)
    capsys.readouterr()
    assert cli([*args, "--model", str(no_template)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire generate: --chat: this tokenizer has no chat template")


def test_generate_seeded_sampling_is_reproducible(tiny_dir, capsys):
    args = ["generate", "--model", str(tiny_dir), "--prompt", "abc", "--temperature", "1.0"]
    args += ["--max-new-tokens", "10", "--num-return-sequences", "3"]
    outputs = []
    for seed in ("7", "7", "8"):
        assert cli([*args, "--seed", seed]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert outputs[0].count("--- ") == 3  # three completions, each marked


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-return-sequences", "2"], "needs --temperature > 0"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_generate_bad_arguments(tmp_path, capsys, extra, message):
    # Checked before loading: the model path does not even need to exist.
    assert cli(["generate", "--model", str(tmp_path / "none"), "--prompt", "x", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire generate: ") and message in err


def test_merge_lora_reward_model_adapter(tiny_dir, tmp_path):
    """A SEQ_CLS adapter (reward modelling) merges into a 1-label sequence classifier."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    model = get_peft_model(base, lora)
    with torch.no_grad():  # B starts at zero; make the adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "rm")
    assert cli(["merge-lora", "--adapter", str(tmp_path / "rm"), "--out", str(tmp_path / "m")]) == 0

    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    reloaded = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1),
        str(tmp_path / "rm"),
    ).eval()
    expected = logits_of(reloaded)
    assert expected.shape == (1, 1)
    torch.testing.assert_close(logits_of(merged), expected, atol=1e-5, rtol=1e-5)


def test_loaded_model_without_a_pad_id_takes_the_shared_pad_rule(tiny_dir, tmp_path):
    """A saved model whose config and tokenizer give no pad id gets the one rule of
    ``columns.pad_token_id_of`` (the tokenizer's EOS here), not None: sequence scores need one."""
    from grimoire.columns import pad_token_id_of
    from grimoire.tools.common import load_for_inference

    folder = tmp_path / "no-pad"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("pad_token_id", None)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)

    model, loaded, _ = load_for_inference(folder)
    assert loaded.pad_token_id is None
    assert model.config.pad_token_id == loaded.eos_token_id == pad_token_id_of(loaded)
