"""forward/completions.py's row selection of a padded completion batch, hand-worked."""

from __future__ import annotations

import torch

from grimoire.contract.layout import LAYOUT_KEY, Padded
from grimoire.forward.completions import select_rows


def group_batch() -> dict:
    """Three rows of ``[prompt P=2 | completion C=4]``: completions of 3, 1 and 2 tokens."""
    return {
        "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]),
        "old_logps": torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-4.0, 0, 0, 0], [-5.0, -6.0, 0, 0]]),
        "input_ids": torch.tensor([[0, 7, 1, 2, 3, 0], [8, 9, 4, 0, 0, 0], [0, 6, 5, 5, 0, 0]]),
        "attention_mask": torch.tensor(
            [[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
        ),
        LAYOUT_KEY: Padded(rows=3),
    }


def test_selected_rows_keep_their_order_and_the_width_of_the_longest():
    out = select_rows(group_batch(), [2, 1])
    # Rows 2 and 1: the longest completion has 2 tokens, so C = 2 and P + C = 4.
    assert out["completion_mask"].tolist() == [[1, 1], [1, 0]]
    assert out["old_logps"].tolist() == [[-5.0, -6.0], [-4.0, 0.0]]
    assert out["input_ids"].tolist() == [[0, 6, 5, 5], [8, 9, 4, 0]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 1, 0]]
    assert out[LAYOUT_KEY] == Padded(rows=2)


def test_an_episodes_attended_tokens_set_the_width_not_its_loss_mask():
    batch = group_batch()
    # Row 1's completion: one sampled token, then two tokens of a tool result (read, not
    # trained): the attention covers three.
    batch["attention_mask"][1] = torch.tensor([1, 1, 1, 1, 1, 0])
    out = select_rows(batch, [1])
    assert out["completion_mask"].tolist() == [[1, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1]]


def test_no_rows_gives_row_zero_masked_out():
    out = select_rows(group_batch(), [])
    assert out["completion_mask"].tolist() == [[0, 0, 0]]
    assert out["input_ids"].tolist() == [[0, 7, 1, 2, 3]]
    assert out[LAYOUT_KEY] == Padded(rows=1)
