"""docs/callbacks.md states what ``on_step_end`` receives; a real SFT run must deliver exactly that.

The documented SFT metric keys sit between ``<!-- on_step_end:sft -->`` and
``<!-- /on_step_end:sft -->`` as a bullet list (``- `key`: description``). The test fails if the
doc and the trainer / SFTLoss drift apart in either direction.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from tests.helpers.train_utils import quiet_config, train

from grimoire import TrainerCallback
from grimoire.losses import SFTLoss

DOC = Path(__file__).resolve().parents[1] / "docs" / "callbacks.md"
BLOCK = re.compile(r"<!-- on_step_end:sft -->\n(.*?)<!-- /on_step_end:sft -->", re.DOTALL)
BULLET = re.compile(r"^- `([^`]+)`")


def documented_sft_keys() -> list[str]:
    text = DOC.read_text()
    blocks = BLOCK.findall(text)
    assert len(blocks) == 1, f"expected one <!-- on_step_end:sft --> block in {DOC}"
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    keys = []
    for line in lines:
        m = BULLET.match(line)
        assert m, f"every line of the on_step_end:sft block must be '- `key`: ...', got {line!r}"
        keys.append(m.group(1))
    assert keys, "the on_step_end:sft block lists no keys"
    assert len(keys) == len(set(keys)), f"duplicate keys in the doc block: {keys}"
    return keys


class RecordStepEnd(TrainerCallback):
    def __init__(self) -> None:
        self.calls: list[tuple[object, object, dict]] = []
        self.global_steps: list[int] = []

    def on_step_end(self, trainer, step, loss, metrics):
        self.calls.append((step, loss, metrics))
        self.global_steps.append(trainer.global_step)


def test_documented_block_parses():
    keys = documented_sft_keys()
    assert "loss" not in keys  # the loop passes the loss separately


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sft_on_step_end_matches_doc(tmp_path, tiny_model, tokenizer, sft_rows, grad_accum):
    documented = documented_sft_keys()
    rec = RecordStepEnd()
    config = quiet_config(tmp_path, max_steps=2, gradient_accumulation_steps=grad_accum)
    train(tiny_model, tokenizer, sft_rows, SFTLoss(), config, callbacks=[rec])

    assert [step for step, _, _ in rec.calls] == [1, 2]
    assert rec.global_steps == [1, 2]
    for step, loss, metrics in rec.calls:
        assert type(step) is int
        assert type(loss) is float and math.isfinite(loss)
        assert isinstance(metrics, dict)
        assert sorted(metrics) == sorted(documented), (
            f"docs/callbacks.md lists {sorted(documented)} for SFT's on_step_end, "
            f"the trainer delivered {sorted(metrics)}"
        )
        assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
        # The doc says nll is this step's token-mean NLL: the same number as the loss for SFT.
        assert metrics["nll"] == pytest.approx(loss, rel=1e-6)
