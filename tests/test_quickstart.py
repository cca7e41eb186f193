"""The embedded quickstart demo learns: loss falls and held-out exact match beats chance."""

from __future__ import annotations

import json

from grimoire.cli.main import main


def test_quickstart_demo_learns(tmp_path, capsys):
    out = tmp_path / "quickstart"
    # The bundled config exactly as `python -m grimoire.train` runs it (1000 steps, under a minute on 2
    # idle cores), only redirected to tmp. Chance exact match on random reversals is ~0.
    code = main(
        ["train", "--set", f'training.output_dir="{out}"', "--set", f'save_to="{out / "final"}"']
    )
    assert code == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert train[0] > 2.0 and train[-1] < 0.5 * train[0], train
    assert evals[-1]["eval/exact_match"] > 0.10, evals[-1]
    assert (out / "final" / "model.safetensors").exists()
    printed = capsys.readouterr().out
    assert "exact_match" in printed
