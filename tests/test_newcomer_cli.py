"""A newcomer's first ten minutes, as the real ``grimoire`` command: each test runs it in a
subprocess from an empty folder, with the library noise switches that ``conftest.py`` sets for
the in-process tests removed, so the command has to quiet (or report) everything itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import grimoire
from grimoire.cli.main import COMMANDS, TOOL_COMMANDS
from grimoire.model.tiny import preference_rows, reverse_rows, write_jsonl

SRC = Path(grimoire.__file__).resolve().parents[1]
#: Set by conftest.py (or a developer's shell) to quiet the libraries; a user has none of them.
NOISE_SWITCHES = (
    "TRANSFORMERS_VERBOSITY",
    "DATASETS_VERBOSITY",
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS",
    "PYTHONWARNINGS",
)
LIBRARY_NOISE = ("Loading weights", "Writing model shards", "UserWarning", "FutureWarning")


def after_phases(stderr: str, command: str = "train") -> str:
    """A failed run's one message: what follows the phase lines (``loading ... ...``, ``...: done
    in 0.3s``) that ``grimoire train`` prints as it goes; nothing else precedes it."""
    start = stderr.index(f"grimoire {command}: ")
    before = stderr[:start].splitlines()
    assert all(line.endswith(" ...") or ": done in " in line for line in before), stderr
    return stderr[start:]


def grimoire_cmd(cwd: Path, *args: str, extra_path: Path | None = None):
    """``python -m grimoire ARGS`` in ``cwd``, offline, this checkout's package first."""
    env = {k: v for k, v in os.environ.items() if k not in NOISE_SWITCHES}
    paths = [str(SRC), *([str(extra_path)] if extra_path else []), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "grimoire", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def empty(tmp_path):
    """The working folder: empty. Configs and data live beside it, named by absolute path."""
    work = tmp_path / "work"
    work.mkdir()
    return work


# --------------------------------------------------------------------------- 1. paths and names


def test_validate_reports_every_missing_path_and_name_at_once(tmp_path, empty):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        """
model:
  pretrained: ./output/quickstart/final         # the SFT quickstart was never run here
  tokenizer: grimoire-tests/not-in-the-cache    # a hub name, offline and not cached
dataset: {jsonl: data/train.jsonl}
eval_dataset: {name: grimoire-tests/no-such-dataset}
loss:
  type: grpo
  ref_model: ./ref-model
  args:
    reward_funcs: [char_match, my_rewards:score]
    num_generations: 4
training:
  output_dir: ./out
  resume_from_checkpoint: ./out/checkpoint-5
callbacks:
  - type: exact_match
  - type: my_callbacks:Nope
"""
    )
    res = grimoire_cmd(empty, "validate", "--config", str(cfg))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "OK" not in res.stdout and "Traceback" not in res.stderr
    err = res.stderr
    assert err.startswith("grimoire validate: invalid configuration (8):"), err
    for expected in (
        "model.pretrained: folder not found: ./output/quickstart/final (relative to the current "
        f"directory, {empty})",
        "model.tokenizer: 'grimoire-tests/not-in-the-cache' is no folder here",
        "offline mode is on",
        "dataset.jsonl: file not found: data/train.jsonl",
        "eval_dataset.name: 'grimoire-tests/no-such-dataset' is not in the local Hugging Face "
        "cache",
        "loss.ref_model: folder not found: ./ref-model",
        "loss.args.reward_funcs[1]: cannot import 'my_rewards:score'",
        "callbacks[1].type: cannot import 'my_callbacks:Nope'",
        "training.resume_from_checkpoint: folder not found: ./out/checkpoint-5",
        "give a checkpoint-<step> folder written by an earlier run, or 'latest'",
    ):
        assert expected in err, (expected, err)
    assert not list(empty.iterdir())  # nothing was written


def test_train_with_a_model_folder_that_is_not_there_is_one_message(tmp_path, empty):
    # examples/grpo_toy.yaml before the quickstart ran: the run used to end in
    # "OSError: Repo id must be in the form 'repo_name' ..." from transformers.
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(
        """
model: {pretrained: ./output/quickstart/final}
dataset: {jsonl: "grimoire://assets/reverse_train.jsonl", tokenize: {type: grpo}}
loss: {type: grpo, args: {reward_funcs: [char_match], num_generations: 4}}
training: {output_dir: ./output/grpo_toy, max_steps: 2}
"""
    )
    res = grimoire_cmd(empty, "train", "--config", str(cfg))
    assert res.returncode == 1
    assert res.stderr.startswith("grimoire train: invalid configuration (1):")
    assert "model.pretrained: folder not found: ./output/quickstart/final" in res.stderr
    assert "Traceback" not in res.stderr and "OSError" not in res.stderr
    assert not list(empty.iterdir())


def test_a_library_error_is_one_message_and_debug_adds_the_traceback(tmp_path, empty):
    # A folder that passes the up-front checks (it holds config.json and tokenizer files) but
    # that transformers cannot load: the error names the key, in one message.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (broken / "tokenizer_config.json").write_text("{}")
    args = ("train", "--set", f"model.pretrained={broken}", "--set", "training.output_dir=out")
    res = grimoire_cmd(empty, *args)
    assert res.returncode == 1
    # The tokenizer is loaded in a phase, whose start line comes first.
    assert after_phases(res.stderr).startswith("grimoire train: invalid configuration (1):\n  - ")
    assert f"model.pretrained: cannot load a tokenizer from '{broken}'" in res.stderr
    assert "Traceback" not in res.stderr
    debug = grimoire_cmd(empty, *args, "--log-level", "DEBUG")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert f"model.pretrained: cannot load a tokenizer from '{broken}'" in debug.stderr

    # An exception Grimoire did not foresee (here: a user's loss class raising RuntimeError)
    # is one message too, with its type and where to find the traceback.
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "boom_loss.py").write_text(
        "class BoomLoss:\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('the loss cannot start')\n"
    )
    data = write_jsonl(reverse_rows(8, seed=0), tmp_path / "train.jsonl")
    cfg = tmp_path / "boom.yaml"
    cfg.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
dataset: {{jsonl: "{data}", tokenize: {{type: sft}}}}
loss: {{type: "boom_loss:BoomLoss"}}
training: {{output_dir: ./out, max_steps: 1}}
"""
    )
    res = grimoire_cmd(empty, "train", "--config", str(cfg), extra_path=plugins)
    assert res.returncode == 1
    assert "grimoire train: RuntimeError: the loss cannot start" in res.stderr, res.stderr
    assert "rerun with --log-level DEBUG for the traceback" in res.stderr
    assert "Traceback" not in res.stderr


# --------------------------------------------------------------------------- 2. help


def test_help_lists_every_command_on_one_line(empty):
    res = grimoire_cmd(empty, "--help")
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("Commands:")) + 2
    block = lines[start : lines.index("", start)]
    # "  <name>   <one line>": every registered command (new ones included), nothing else
    assert [line.split()[0] for line in block] == [*COMMANDS, *TOOL_COMMANDS], res.stdout
    assert all(line.startswith("  ") and len(line.split()) > 2 for line in block), res.stdout
    assert {"train", "validate", "plot", "generate", "merge-lora"} <= {*COMMANDS, *TOOL_COMMANDS}


@pytest.mark.parametrize("command", [None, *COMMANDS, *TOOL_COMMANDS])
def test_every_help_ends_with_an_example(empty, command):
    res = grimoire_cmd(empty, *([command] if command else []), "--help")
    assert res.returncode == 0, res.stderr
    tail = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    head = next(i for i in range(len(tail) - 1, -1, -1) if tail[i] in ("example:", "examples:"))
    examples = tail[head + 1 :]
    assert examples, res.stdout
    prefix = f"grimoire {command}" if command else "grimoire "
    assert all(line.startswith(prefix) for line in examples), res.stdout


# --------------------------------------------------------------------------- 3. quiet by default


OLD_SPELLINGS = """
model:
  name_or_path: "tiny:llama"      # earlier spellings: model.pretrained, model.model_kwargs.dtype
  dtype: float32
dataset: {{jsonl: "grimoire://assets/reverse_train.jsonl", max_samples: 32}}
eval_dataset: {{jsonl: "grimoire://assets/reverse_eval.jsonl", max_samples: 8}}
training:
  output_dir: ./output/run
  max_steps: {steps}
  batch_size: 8
  max_length: 64
  save_steps: 1                   # a checkpoint at every step: torch's single-process warning
  eval_steps: 2
  mixed_precision: "no"
"""
DEPRECATIONS = (
    "grimoire: model.name_or_path is deprecated (grimoire-rl's schema is canonical): write "
    "model.pretrained instead; the old spelling goes away in the next release",
    "grimoire: model.dtype is deprecated (grimoire-rl's schema is canonical): write "
    "model.model_kwargs.dtype instead; the old spelling goes away in the next release",
)


def test_deprecated_spellings_are_one_line_each_once(tmp_path, empty):
    cfg = tmp_path / "old.yaml"
    cfg.write_text(OLD_SPELLINGS.format(steps=2))
    res = grimoire_cmd(empty, "validate", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == list(DEPRECATIONS)


def test_a_normal_run_is_quiet_and_info_lets_the_libraries_speak(tmp_path, empty):
    cfg = tmp_path / "old.yaml"
    cfg.write_text(OLD_SPELLINGS.format(steps=2))
    res = grimoire_cmd(empty, "train", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    printed = res.stdout + res.stderr
    assert not [noise for noise in LIBRARY_NOISE if noise in printed], res.stderr
    assert "== grimoire: training finished ==" in res.stdout
    assert "model saved to: output/run/final" in res.stdout
    assert (empty / "output" / "run" / "checkpoint-2").is_dir()
    # Deprecations: once each (validation and the run both meet them), one line, no echo.
    # Besides them only the phase lines before step 1 (the start and end of each) and the plain
    # per-logging-step lines (stderr is not a terminal here).
    lines = res.stderr.splitlines()
    phase = [line for line in lines if line.endswith(" ...") or ": done in " in line]
    assert phase[0] == "loading the tokenizer of tiny:llama ..." and len(phase) % 2 == 0, phase
    assert [line for line in lines if not line.startswith("step ") and line not in phase] == list(
        DEPRECATIONS
    )
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["2/2", "2/2"]

    verbose = grimoire_cmd(
        empty,
        "train",
        "--config",
        str(cfg),
        "--set",
        "training.output_dir=./output/verbose",
        "--log-level",
        "INFO",
    )
    assert verbose.returncode == 0, verbose.stderr
    assert "Loading weights" in verbose.stderr and "Writing model shards" in verbose.stderr
    assert "INFO grimoire." in verbose.stderr
    assert [line for line in verbose.stderr.splitlines() if "deprecated" in line] == list(
        DEPRECATIONS
    )


# --------------------------------------------------------------------------- 4. data errors


def test_broken_lines_and_bad_rows_come_in_one_message(tmp_path, empty):
    rows = [json.dumps(r) for r in preference_rows(4, seed=0)]
    missing = json.loads(rows[2])
    del missing["rejected"]
    train = tmp_path / "prefs.jsonl"
    train.write_text("\n".join([rows[0], '{"prompt": "x", "chosen": ', json.dumps(missing)]) + "\n")
    # 30 bad lines in the eval file: listed up to the 20-problem limit, the rest counted.
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join("{oops\n" if i % 2 else json.dumps(missing) + "\n" for i in range(30)))
    cfg = tmp_path / "prefs.yaml"
    cfg.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
dataset: {{jsonl: "{train}"}}
eval_dataset: {{jsonl: "{evals}"}}
loss: {{type: simpo}}
training: {{output_dir: ./out, max_steps: 1}}
"""
    )
    res = grimoire_cmd(empty, "train", "--config", str(cfg))
    assert res.returncode == 1
    err = after_phases(res.stderr)
    assert err.startswith("grimoire train: invalid data (nothing was loaded or trained)"), err
    assert f"{train}:2: invalid JSON" in err
    assert f"{train}:3: tokenize_preference: missing field 'rejected'" in err
    assert f"{evals}:2: invalid JSON" in err and f"{evals}:1: tokenize_preference" in err
    assert "... and 10 more" in err
    assert "Traceback" not in err
    assert not (empty / "out" / "metrics.jsonl").exists()


def test_main_called_from_python_puts_the_output_settings_back(tmp_path, capsys):
    # The quieting is the command's, for one command: a Python caller of main() keeps its own
    # warnings filters, environment, library log levels and progress-bar switches.
    from huggingface_hub.utils import are_progress_bars_disabled

    from grimoire.cli.main import main
    from grimoire.cli.output import LIBRARY_LOGGERS, QUIET_ENV

    def state():
        return (
            list(warnings.filters),
            warnings.showwarning,
            {k: os.environ.get(k) for k in QUIET_ENV},
            {n: logging.getLogger(n).level for n in LIBRARY_LOGGERS},
            are_progress_bars_disabled(),
        )

    cfg = tmp_path / "old.yaml"
    cfg.write_text(OLD_SPELLINGS.format(steps=2))
    before = state()
    assert main(["validate", "--config", str(cfg)]) == 0
    assert state() == before
    assert capsys.readouterr().err.splitlines() == list(DEPRECATIONS)
