"""Walls a TRL user hit fine-tuning a real model with the CLI (issue 44, item 6), each checked
on a tiny model: no epoch-end checkpoint duplicating the final export unless asked, and the
summary saying what was written and how large; phase lines before the first step when the
output is not a terminal; TRL-name hints whose replacement validates; no DeepSpeed import (and
its "Setting accelerator to CPU" line) in a run that does not use it.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.helpers.commands import ROOT, run
from tests.helpers.train_utils import quiet_config, train

from grimoire.cli.main import summarize
from grimoire.cli.schema import validate_config
from grimoire.compat.trl_names import TRL_NAMES, Choose, replacement, trl_hint, written
from grimoire.config import registry
from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.model.tiny import preference_rows, write_jsonl
from grimoire.tools.memory.run_config import plan_from_config
from grimoire.training import phases
from grimoire.training.report import folder_bytes, human_size

# ------------------------------------------------------------------ checkpoint defaults


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def test_default_writes_no_epoch_checkpoint_at_the_step_that_ends_the_run(
    tmp_path, tiny_model, tokenizer, sft_rows
):
    assert TrainingConfig().save_on_epoch_end is None  # auto
    rows = sft_rows[:8]  # 2 steps an epoch at batch_size 4
    config = quiet_config(tmp_path, num_epochs=2, save_on_epoch_end=None)
    trainer = train(tiny_model, tokenizer, rows, SFTLoss(), config)
    # Epoch 1's checkpoint (a resume point) stays; epoch 2's would duplicate the final model.
    assert trainer.global_step == 4 and _checkpoints(tmp_path) == ["checkpoint-2"]
    trainer.save_model(tmp_path / "final")

    summary = json.loads((tmp_path / "run_summary.json").read_text())
    sizes = {e["path"]: (e["kind"], e["bytes"]) for e in summary["written"]}
    assert sizes == {
        str(tmp_path / "checkpoint-2"): ("checkpoint", folder_bytes(tmp_path / "checkpoint-2")),
        str(tmp_path / "final"): ("model", folder_bytes(tmp_path / "final")),
    }
    # A checkpoint holds the optimizer state besides the weights: larger than the export.
    assert sizes[str(tmp_path / "checkpoint-2")][1] > sizes[str(tmp_path / "final")][1] > 0
    text = summarize(tmp_path, str(tmp_path / "final"))
    for path, (_, size) in sizes.items():
        assert any(path in line and line.endswith(human_size(size)) for line in text.split("\n"))


@pytest.mark.parametrize(
    ("asked", "want"),
    [
        ({"save_on_epoch_end": True}, ["checkpoint-2", "checkpoint-4"]),  # asked: the last too
        ({"save_on_epoch_end": False}, []),
        ({"save_on_epoch_end": None, "save_steps": 4}, ["checkpoint-2", "checkpoint-4"]),
    ],
)
def test_an_asked_checkpoint_at_the_last_step_is_written(
    tmp_path, tiny_model, tokenizer, sft_rows, asked, want
):
    config = quiet_config(tmp_path, num_epochs=2, save_total_limit=None, **asked)
    train(tiny_model, tokenizer, sft_rows[:8], SFTLoss(), config)
    assert _checkpoints(tmp_path) == want


def test_human_sizes():
    assert [human_size(n) for n in (0, 1023, 1536, 5 * 2**20, int(2.2 * 2**30))] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "2.2 GiB",
    ]


# ------------------------------------------------------------------ progress off a terminal


def test_a_long_pass_reports_rows_off_a_terminal():
    stream = io.StringIO()  # not a terminal: lines, no bar
    with phases.reporting(stream=stream), phases.phase("scoring", total=100) as running:
        for _ in range(20):
            running.advance(5)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "scoring ..."
    assert [line.split(": ")[1].split()[0] for line in lines[1:-1]] == [
        f"{n}/100" for n in range(10, 100, 10)
    ]
    assert lines[-1].startswith("scoring: done in ") and lines[-1].endswith("s (100 rows)")
    assert "\r" not in stream.getvalue()


def test_phase_lines_are_log_records_outside_the_cli(caplog):
    with caplog.at_level("INFO", logger="grimoire.training.phases"), phases.phase("loading"):
        pass
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["loading ...", "loading"]


def test_cli_reports_phases_before_the_first_step_and_never_imports_deepspeed(tmp_path):
    """A DPO run with precompute_ref_log_probs, output captured (not a terminal): each phase's
    start and end, and the reference pass's rows, come before step 1's line; DeepSpeed (installed
    here) is never imported, so its "Setting accelerator to CPU" line is not printed."""
    data = write_jsonl(preference_rows(16, seed=0), tmp_path / "pref.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"pretrained": "tiny:llama"},
                "dataset": {"jsonl": str(data)},
                "loss": {"type": "dpo"},
                "training": {
                    "output_dir": str(tmp_path / "out"),
                    "max_steps": 2,
                    "batch_size": 4,
                    "logging_steps": 1,
                    "precompute_ref_log_probs": True,
                    "mixed_precision": "no",
                },
                "save_to": False,
            }
        )
    )
    script = (
        "import sys\n"
        "from grimoire.cli.main import main\n"
        f"code = main(['train', '--config', {str(config)!r}])\n"
        "print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    done = run([sys.executable, "-c", script], tmp_path, timeout=300)
    assert "deepspeed imported: False" in done.stdout
    assert "real_accelerator" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    tokens = tmp_path / "out" / "tiny-model"
    expected = [
        "loading the tokenizer of tiny:llama ...",
        "loading the tokenizer of tiny:llama: done in ",
        "reading and tokenizing dataset ...",
        "reading and tokenizing dataset: done in ",
        f"loading the model {tokens} ...",
        f"loading the model {tokens}: done in ",
        "setting up the trainer ...",
        "reference log-probs of the train rows ...",
        "reference log-probs of the train rows: 4/16 rows",
        "reference log-probs of the train rows: done in ",
        "setting up the trainer: done in ",
        "step 1/2 ",
    ]
    found = [next(i for i, line in enumerate(lines) if line.startswith(e)) for e in expected]
    assert found == sorted(found), done.stderr
    assert lines[found[9]].endswith("(16 rows)")


# ------------------------------------------------------------------ TRL names


def _base(loss: str) -> dict[str, Any]:
    """A valid config whose ``loss.args`` / ``dataset.tokenize`` take the hints' arguments."""
    raw: dict[str, Any] = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": str(ROOT / "src/grimoire/assets/reverse_train.jsonl")},
        "loss": {"type": loss, "args": {}},
        "training": {},
    }
    if loss == "dpo":
        raw["loss"]["ref_model"] = "copy"
    if loss == "grpo":
        raw["loss"]["args"] = {"reward_funcs": ["char_match"]}
    return raw


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


HINTS = [(name, example) for name, entry in TRL_NAMES.items() for example in entry.examples]


@pytest.mark.parametrize("where", ["training", "loss.args"])
@pytest.mark.parametrize(("name", "example"), HINTS, ids=[f"{n}={e!r}" for n, e in HINTS])
def test_every_trl_hint_suggests_a_replacement_that_validates(name, example, where):
    """Given TRL's name (in ``training:`` or ``loss.args``), the config fails with the hint as its
    one problem; written as the hint says (its YAML, or the example a placeholder stands for),
    the config is valid, and a loss argument is one the loss accepts."""
    entry = TRL_NAMES[name]
    raw = _base(entry.loss)
    section = raw["training"] if where == "training" else raw["loss"]["args"]
    section[name] = copy.deepcopy(example)
    hint = trl_hint(name, example, where)
    target, ours = replacement(name, example)
    if hint is None:  # TRL's name is ours there: accepted as it is
        assert target == f"{where}.{name}" and validate_config(raw) == []
        return
    assert validate_config(raw) == [hint]
    text = written(name, example, where)
    assert f"write {text}" in hint
    del section[name]
    if isinstance(ours, Choose):  # TRL's value does not say ours: the hint shows a placeholder
        assert ours.text in text
        _merge(raw, _nested(target, ours.example))
    else:  # the hint's YAML, as a user would paste it
        pasted = yaml.safe_load(f"{{{text}}}")
        _merge(section if target.startswith(f"{where}.") else raw, pasted)
        assert pasted == _nested(target.removeprefix(f"{where}."), ours) or pasted == _nested(
            target, ours
        )
    assert validate_config(raw) == [], (hint, raw)
    TrainingConfig.from_dict(raw["training"])
    loss_cls = registry.resolve(raw["loss"]["type"], registry.LOSSES, "loss.type")
    loss_cls(**raw["loss"]["args"])  # the values too: checked when the loss is built


def test_report_to_none_and_max_completion_length_the_reported_walls():
    raw = _base("grpo")
    raw["training"]["report_to"] = "none"
    raw["loss"]["args"]["max_completion_length"] = 64
    problems = validate_config(raw)
    assert any("training.report_to" in p and "write log_with: null" in p for p in problems)
    assert any(
        "loss.args.max_completion_length" in p and "write max_new_tokens: 64" in p for p in problems
    ), problems
    # The config knows no TRL names; the entry points hand it the hint (estimate-memory too).
    with pytest.raises(ConfigError, match="write mixed_precision: 'no'"):
        TrainingConfig.from_dict({"bf16": False}, hint=trl_hint)
    with pytest.raises(ConfigError, match="write mixed_precision: 'no'"):
        plan_from_config({"training": {"bf16": False}})
    with pytest.raises(ConfigError, match="training.bf16: unknown key"):
        TrainingConfig.from_dict({"bf16": False})
