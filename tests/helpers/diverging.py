"""The diverging CLI run (SFT at learning rate 1e6) that the non-finite guard must stop."""

from __future__ import annotations

from pathlib import Path

from grimoire.model.tiny import reverse_rows, write_jsonl


def diverging_run_config(folder: Path) -> tuple[Path, Path]:
    """Write the run's data and YAML config under ``folder``; return (config, output dir).

    Every step's loss or gradient norm goes non-finite within a few steps, so the run must stop
    with the diverged message, a non-zero exit and no model at ``<output dir>/final``."""
    data = write_jsonl(reverse_rows(64, seed=0), folder / "train.jsonl")
    out = folder / "out"
    config = folder / "run.yaml"
    config.write_text(
        f"""
model: {{pretrained: "tiny:llama"}}
dataset: {{jsonl: {data}, tokenize: {{type: sft}}}}
loss: {{type: sft}}
training: {{output_dir: {out}, max_steps: 30, batch_size: 4, learning_rate: 1.0e6,
  max_length: 64, mixed_precision: "no", progress_bar: false, save_on_epoch_end: false}}
save_to: {out / "final"}
"""
    )
    return config, out
