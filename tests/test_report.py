"""What a run leaves for people: the progress bar (only on a terminal), ``run_summary.json``
and the model card written next to a saved model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from tests.helpers.train_utils import quiet_config, train

from grimoire import TrainerCallback, TrainingConfig
from grimoire.losses import DPOLoss, SFTLoss
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import preference_rows, reverse_rows
from grimoire.rollout.rewards.scoring import char_match_reward
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.callbacks import ProgressCallback


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, so the bar draws into memory we can read."""

    def isatty(self) -> bool:
        return True


def _records(output_dir: Path, split: str = "train") -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _yaml_blocks(card: str) -> list:
    return [yaml.safe_load(block.split("```")[0]) for block in card.split("```yaml\n")[1:]]


# --------------------------------------------------------------------------- progress bar


def test_progress_bar_on_a_terminal_shows_steps_loss_tokens_per_sec_and_reward(
    tmp_path, tiny_model, tokenizer
):
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(8, seed=7)]
    method = GRPOMethod([char_match_reward], num_generations=2, max_new_tokens=4)
    screen = FakeTerminal()
    # progress_bar=False drops only the built-in bar; the one passed in draws on `screen`.
    config = quiet_config(tmp_path, max_steps=2, batch_size=2)
    trainer = train(
        tiny_model, tokenizer, rows, method, config, callbacks=[ProgressCallback(screen)]
    )
    shown = screen.getvalue()
    last = _records(tmp_path)[-1]
    assert "2/2" in shown
    final = shown.split("\r")[-1]  # the bar's last redraw
    assert f"loss={last['loss']:.4f}" in final
    assert f"reward={last['rewards/mean']:.3f}" in final
    assert f"tok/s={last['tokens_per_sec']:.0f}" in final
    assert trainer.callbacks.callbacks[0].bar is None  # closed at the end


def test_no_bar_but_plain_lines_when_the_stream_is_not_a_terminal(tmp_path, tiny_model, tokenizer):
    rows = [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 8
    log_file = io.StringIO()  # a redirected stderr, e.g. a job's log file
    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            seen.append(bar.bar)

    bar = ProgressCallback(log_file)
    train(
        tiny_model,
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path, max_steps=2),
        callbacks=[bar, Probe()],
    )
    # No bar (its carriage returns are noise in a file): one plain line per logging step.
    assert seen == [None, None] and "\r" not in log_file.getvalue()
    lines = log_file.getvalue().splitlines()
    records = [r for r in _records(tmp_path) if r["split"] == "train"]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert all(f"loss {r['loss']:.4f}" in line for line, r in zip(lines, records, strict=True))


def test_only_the_first_progress_callback_draws(tmp_path, tiny_model, tokenizer):
    rows = [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 8
    first, second = FakeTerminal(), FakeTerminal()
    callbacks = [ProgressCallback(first), ProgressCallback(second)]
    train(
        tiny_model,
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path, max_steps=2),
        callbacks=callbacks,
    )
    assert "2/2" in first.getvalue()
    assert second.getvalue() == ""


# --------------------------------------------------------------------------- run summary


def test_run_summary_json_matches_the_trainer_and_the_metrics_log(
    tmp_path, tiny_model, tokenizer, sft_rows
):
    config = quiet_config(tmp_path, max_steps=3, save_steps=2)
    trainer = train(tiny_model, tokenizer, sft_rows[:24], SFTLoss(), config)
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    records = _records(tmp_path)
    assert summary["steps"] == 3 and summary["max_steps"] == 3
    assert summary["tokens"] == trainer.state.tokens_seen == records[-1]["tokens"]
    assert summary["stopped_early"] is False and trainer.stopped_early is False
    assert summary["precision"]["requested"] == "no" == summary["precision"]["resolved"]
    assert summary["loss_first"] == records[0]["loss"]
    assert summary["loss_last"] == records[-1]["loss"]
    assert summary["checkpoints"] == [str(tmp_path / "checkpoint-2")]
    assert summary["saved_model"] is None
    assert summary["wall_time_s"] > 0 and summary["peak_memory_mb"] > 0
    assert not list(tmp_path.glob(".run_summary.json.tmp*"))  # written via a temporary file

    trainer.save_model(tmp_path / "final")
    saved = json.loads((tmp_path / "run_summary.json").read_text())
    assert saved["saved_model"] == str(tmp_path / "final")


def test_run_summary_records_an_early_stop(tmp_path, tiny_model, tokenizer, sft_rows):
    class StopAtTwo(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics):
            if step == 2:
                trainer.request_stop()

    config = quiet_config(tmp_path, max_steps=5)
    trainer = train(
        tiny_model, tokenizer, sft_rows[:40], SFTLoss(), config, callbacks=[StopAtTwo()]
    )
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert (summary["steps"], summary["max_steps"], summary["stopped_early"]) == (2, 5, True)
    assert summary["tokens"] == trainer.state.tokens_seen


# --------------------------------------------------------------------------- model card


@pytest.fixture
def dpo_trainer(tmp_path, tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    rows = [tokenize_preference(r, tokenizer, 64) for r in preference_rows(12, seed=1)]
    config = quiet_config(tmp_path / "run", max_steps=2, learning_rate=5e-4)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    return train(
        policy, tokenizer, rows, DPOLoss(beta=0.3, loss_type="ipo", ref_model="copy"), config
    )


def test_model_card_from_python_names_base_method_data_steps_and_config(
    dpo_trainer, tiny_dir, tmp_path
):
    out = dpo_trainer.save_model(tmp_path / "final")
    card = (out / "README.md").read_text()
    front = _front_matter(card)
    assert front["library_name"] == "grimoire"
    assert front["base_model"] == str(tiny_dir)
    assert "dpo" in front["tags"]
    assert "`DPOLoss`" in card
    assert "| beta | 0.3 |" in card and "| loss_type | ipo |" in card
    assert "- train rows: 12" in card
    assert "- steps: 2 of 2" in card
    assert f"- tokens: {dpo_trainer.state.tokens_seen}" in card
    last = _records(tmp_path / "run")[-1]
    assert f"| loss | {last['loss']:.6g} |" in card
    assert "Launched from Python" in card
    (config,) = _yaml_blocks(card)
    assert TrainingConfig(**config) == dpo_trainer.config  # the reproduce section round-trips


def test_model_card_renders_the_cli_command_and_its_config(dpo_trainer, tmp_path):
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": "prefs.jsonl", "tokenize": {"type": "preference"}},
        "loss": {"type": "dpo", "args": {"beta": 0.3}},
        "training": {"max_steps": 2, "learning_rate": 5.0e-4},
    }
    dpo_trainer.launch = {"command": "grimoire train --config dpo.yaml", "config": raw}
    card = (dpo_trainer.save_model(tmp_path / "final") / "README.md").read_text()
    assert "```bash\ngrimoire train --config dpo.yaml\n```" in card
    dataset, config = _yaml_blocks(card)
    assert dataset == raw["dataset"]  # the data section names the source
    assert config == raw
    assert "Launched from Python" not in card
