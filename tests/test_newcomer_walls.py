"""A newcomer's walls, each checked through the real entry point: CLI errors name the YAML key
that fixes them (the Python API keeps its own wording), ``validate`` runs the reference check,
the config's folder is on the import path for ``package.module:Name`` specs, an unreachable hub
fails in one line, plain log lines when stderr is not a terminal, TRL's ``TrainingArguments``
names answered with ours, ``estimate-memory`` on a tiny model and when nothing fits,
``grimoire.resolve_path``, ``generate --model RUN_DIR``, one plot panel per distinct curve, and
the reward-model loss's YAML name in the docs.
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.helpers.commands import ROOT, command_env, grimoire_command, run
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.cli.main import main
from grimoire.cli.schema import validate_config
from grimoire.compat.trl_names import trl_hint
from grimoire.config import registry
from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError, DataError
from grimoire.forward.reference import Reference
from grimoire.losses import DPOLoss, SFTLoss
from grimoire.losses.dpo import REF_PAIR_COLUMNS
from grimoire.model.tiny import build_model, preference_rows, reverse_rows, save_tiny, write_jsonl
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.sft import tokenize_sft
from grimoire.training.callbacks import ProgressCallback


@pytest.fixture(autouse=True)
def _sys_path_back(monkeypatch):
    """main() puts the config's folder and the working directory on sys.path: undo it."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def _config(tmp_path: Path, rows: list[dict], **sections) -> Path:
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(data)},
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1},
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ------------------------------------------------------------------ errors speak YAML


def test_validate_refuses_dpo_without_reference_naming_yaml_keys(tmp_path, capsys):
    cfg = _config(tmp_path, preference_rows(4, seed=0), loss={"type": "dpo"})
    assert main(["validate", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "loss.ref_model: copy" in err and "a peft: section" in err
    assert "training.precompute_ref_log_probs: true" in err
    assert "peft_config=" not in err and "ref_model=" not in err
    # Given a reference, the same config is valid.
    cfg.write_text(cfg.read_text().replace("type: dpo", "type: dpo\n  ref_model: copy"))
    assert main(["validate", "--config", str(cfg)]) == 0, capsys.readouterr().err


def test_python_api_keeps_python_wording_for_the_same_problem(tmp_path, tokenizer):
    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, seed=0)]
    with pytest.raises(ConfigError, match=r"peft_config=LoraConfig\(\.\.\.\)") as err:
        GrimoireTrainer(
            model=build_model(seed=0),
            tokenizer=tokenizer,
            config=quiet_config(tmp_path, max_steps=1),
            loss_fn=DPOLoss(),
            train_dataset=rows,
        )
    # The CLI's rewording of that very message names the YAML keys.
    from grimoire.cli.wording import yaml_wording

    worded = yaml_wording(str(err.value))
    assert "set loss.ref_model: copy" in worded and "add a peft: section" in worded
    assert "peft_config" not in worded


def test_reference_message_with_cache_hint_is_reworded_whole():
    from grimoire.cli.wording import yaml_wording

    message = Reference(None, "DPOLoss", REF_PAIR_COLUMNS)._missing("train")
    worded = yaml_wording(message)
    assert "training.precompute_ref_log_probs: true" in worded
    assert "loss.cache_reference: true" in worded
    assert not re.search(r"\w=\S", worded), worded  # no Python keyword argument left


@pytest.mark.parametrize("where", ["dataset", "eval_dataset"])
def test_cli_data_error_names_the_tokenize_key_of_its_section(tmp_path, capsys, where):
    rows = [{"prompt": r["prompt"], "answer": r["response"]} for r in reverse_rows(3, seed=0)]
    good = write_jsonl(reverse_rows(3, seed=1), tmp_path / "good.jsonl")
    cfg = _config(tmp_path, rows)
    raw = yaml.safe_load(cfg.read_text())
    if where == "eval_dataset":  # the bad rows in the eval set only
        raw["eval_dataset"], raw["dataset"] = raw["dataset"], {"jsonl": str(good)}
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["validate", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"(set {where}.tokenize.response_field: <column> to use another column)" in err
    assert "tokenize_sft(..., response_field=...)" not in err
    with pytest.raises(DataError, match=r"pass tokenize_sft\(\.\.\., response_field=\.\.\.\)"):
        tokenize_sft(rows[0], build_tokenizer_for_test())


def test_row_with_none_of_the_fields_is_answered_with_the_tokenize_keys():
    from grimoire.cli.wording import yaml_wording

    with pytest.raises(DataError) as err:
        tokenize_sft({"question": "q"}, build_tokenizer_for_test())
    assert "pass prompt_field=/response_field=/text_field=/messages_field=" in str(err.value)
    worded = yaml_wording(f"{err.value} (eval_dataset row 2)")
    keys = ("prompt_field", "response_field", "text_field", "messages_field")
    assert "(set " + " / ".join(f"eval_dataset.tokenize.{k}" for k in keys) in worded


def build_tokenizer_for_test():
    from grimoire.model.tiny import build_tokenizer

    return build_tokenizer()


# ------------------------------------------------------------------ import path


def test_reward_module_beside_the_config_is_importable(tmp_path):
    conf, work = tmp_path / "conf", tmp_path / "work"
    conf.mkdir()
    work.mkdir()
    (conf / "myrewards_nc2.py").write_text(
        "def a_count(prompts, completions, **kw):\n    return [float(c.count('a')) for c in completions]\n"
    )
    loss = {
        "type": "grpo",
        "args": {"reward_funcs": ["myrewards_nc2:a_count"], "num_generations": 2},
    }
    cfg = _config(conf, reverse_rows(4, seed=0), loss=loss)
    done = run([*grimoire_command(), "validate", "--config", str(cfg)], work, expect=None)
    assert done.returncode == 0, done.stderr
    assert "OK:" in done.stdout
    # The working directory is on the path too.
    (conf / "myrewards_nc2.py").rename(work / "myrewards_nc2.py")
    done = run([*grimoire_command(), "validate", "--config", str(cfg)], work, expect=None)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------ the hub, unreachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_hub_probe_tells_a_closed_port_from_a_listening_one():
    from grimoire.cli.paths import hub_unreachable

    port = _closed_port()
    assert "127.0.0.1" in hub_unreachable(f"http://127.0.0.1:{port}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert hub_unreachable(f"http://127.0.0.1:{server.getsockname()[1]}") is None


def test_uncached_hub_model_with_hub_unreachable_fails_in_one_line(tmp_path):
    cfg = _config(tmp_path, reverse_rows(2, seed=0))
    cfg.write_text(cfg.read_text().replace("tiny:llama", "someorg/not-a-cached-model"))
    env = {
        **command_env(),
        "HF_HUB_OFFLINE": "0",  # online mode, but the hub is a closed loopback port
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "HF_HOME": str(tmp_path / "hf"),
    }
    done = subprocess.run(
        [*grimoire_command(), "validate", "--config", str(cfg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    problems = [line for line in lines if line.startswith("  - ")]
    assert len(problems) == 1, done.stderr
    assert "model.pretrained: 'someorg/not-a-cached-model'" in problems[0]
    assert "the hub cannot be reached" in problems[0] and "HF_HUB_OFFLINE=1" in problems[0]
    assert "Retrying" not in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ plain log lines


def test_plain_line_per_logging_step_when_stream_is_not_a_terminal(tmp_path, tokenizer):
    rows = [tokenize_sft(r, tokenizer, max_length=64) for r in reverse_rows(16, seed=3)]
    stream = io.StringIO()  # a file, as under nohup or Slurm: isatty() is False
    config = quiet_config(tmp_path, max_steps=4, logging_steps=2, batch_size=4)
    trainer = GrimoireTrainer(
        model=build_model(seed=0),
        tokenizer=tokenizer,
        config=config,
        loss_fn=SFTLoss(),
        train_dataset=rows,
        callbacks=[ProgressCallback(stream=stream)],
    )
    trainer.train()
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if r["split"] == "train"]
    lines = stream.getvalue().splitlines()
    assert (
        [line.split()[1] for line in lines] == [f"{r['step']}/4" for r in logged] == ["2/4", "4/4"]
    )
    for line, rec in zip(lines, logged):
        assert f"loss {rec['loss']:.4f}" in line and "tok/s" in line
    assert "\r" not in stream.getvalue()


# ------------------------------------------------------------------ TRL names


def test_trl_training_argument_names_are_answered_with_ours():
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(ROOT / "src/grimoire/assets/reverse_train.jsonl")},
        "training": {
            "per_device_train_batch_size": 8,
            "bf16": True,
            "num_train_epochs": 2,
            "gradient_checkpointing": True,  # also ours
            "learning_rate": 1e-4,  # also ours
            "warmup_steps": 10,  # also ours
        },
    }
    problems = validate_config(raw)
    assert len(problems) == 3, problems
    assert any("per_device_train_batch_size" in p and "write batch_size: 8" in p for p in problems)
    assert any("training.bf16" in p and "write mixed_precision: bf16" in p for p in problems)
    assert any("num_train_epochs" in p and "write num_epochs: 2" in p for p in problems)
    assert not any("did you mean" in p for p in problems)
    with pytest.raises(ConfigError, match="write batch_size: 4"):
        TrainingConfig.from_dict({"per_device_train_batch_size": 4}, hint=trl_hint)


# ------------------------------------------------------------------ estimate-memory


def test_estimate_memory_on_the_quickstart_shows_the_tiny_model(capsys):
    quickstart = str(ROOT / "examples" / "quickstart.yaml")
    assert main(["estimate-memory", "--config", quickstart]) == 0
    out = capsys.readouterr().out
    model = build_model(seed=0)  # the quickstart's tiny:llama (tied embeddings)
    params = sum(p.numel() for p in model.parameters())
    assert f"tiny:llama: {params / 1e3:.4g}K parameters" in out
    weights = re.search(r"^\| weights \| ([\d.e-]+) \|", out, re.M)
    assert float(weights.group(1)) == pytest.approx(params * 4 / 2**30, rel=0.02)


def test_estimate_memory_that_does_not_fit_exits_2_with_what_would(capsys):
    model = str(ROOT / "docs" / "memory" / "llama-3-8b.json")
    args = ["estimate-memory", "--model", model, "--world-size", "8"]
    ckpt_off = ["--set", "training.gradient_checkpointing=false"]
    assert main([*args, *ckpt_off]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "what fits" in out
    assert "training.distributed: fsdp2" in out
    assert main([*args, "--device-memory", "1"]) == 2
    assert "suggestion: none of" in capsys.readouterr().out
    assert main([*args, "--set", "training.distributed=fsdp2"]) == 0


# ------------------------------------------------------------------ grimoire://, generate


def test_resolve_path_gives_the_bundled_model_to_from_pretrained():
    from transformers import AutoModelForCausalLM

    from grimoire import resolve_path

    folder = resolve_path("grimoire://assets/reverse_warm")
    assert (folder / "config.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(folder).config.hidden_size > 0
    assert resolve_path("some/relative/dir") == Path("some/relative/dir")


def test_generate_given_a_run_folder_points_to_its_final_model(tmp_path, capsys):
    save_tiny(tmp_path / "run" / "final")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert main(["generate", "--model", str(tmp_path / "run"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert f"give --model {tmp_path / 'run' / 'final'}" in err


# ------------------------------------------------------------------ plot, docs


def test_identical_curves_share_one_plot_panel(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        {
            "split": "train",
            "step": s,
            "loss": 1.0 / s,
            "reward": 0.1 * s,
            "rewards/mean": 0.1 * s,
            "rewards/length/mean": 0.1 * s,
            "rewards/std": 0.5,
        }
        for s in (1, 2, 3)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "p.html"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    text = out.read_text()
    panels = re.findall(r'<figure class="panel" data-metric="([^"]+)"', text)
    assert panels == ["loss", "reward", "rewards/std"]
    assert "reward (= rewards/mean, rewards/length/mean)" in text


def test_every_loss_short_name_is_in_the_cli_docs():
    doc = (ROOT / "docs" / "cli.md").read_text()
    bullet = doc[doc.index("**`loss.type` short names**") :].split("\n- ")[0]
    for name in registry.LOSSES:
        assert f"`{name}`" in bullet, name
    assert "RewardModelLoss" in bullet
