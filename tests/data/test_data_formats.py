"""docs/data-formats.md's table, run: every example row is detected as the format it names and
tokenized by the tokenizer it names with at least one trained token; the detection is logged."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from grimoire.data import (
    tokenize_dataset,
    tokenize_grpo,
    tokenize_kto,
    tokenize_preference,
    tokenize_sft,
)
from grimoire.rows.formats import detect_format

DOC = Path(__file__).resolve().parents[2] / "docs" / "data-formats.md"
TOKENIZERS = {
    "tokenize_sft": tokenize_sft,
    "tokenize_preference": tokenize_preference,
    "tokenize_kto": tokenize_kto,
    "tokenize_grpo": tokenize_grpo,
}
ROW = re.compile(r"^\| ([^|]+) \| (standard|conversational) \| `(\w+)` \| `(\{.*\})` \|$")


def doc_rows():
    rows = [m.groups() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
    assert len(rows) == 13
    return rows


@pytest.mark.parametrize(("name", "kind", "fn", "example"), doc_rows())
def test_documented_example_is_detected_and_tokenized(tokenizer, name, kind, fn, example):
    row = json.loads(example)
    assert detect_format(row) == f"{name.strip()}, {kind}"
    out = TOKENIZERS[fn](row, tokenizer)
    labels = [v for k, v in out.items() if k.endswith("labels")]
    if fn == "tokenize_grpo":  # prompts only: nothing is trained before sampling
        assert out["prompt_input_ids"]
    else:
        assert labels and all(any(t != -100 for t in lab) for lab in labels)


def test_standard_implicit_prompt_is_split_as_trl_does(tokenizer):
    out = tokenize_preference(
        {"chosen": "the sky is blue.", "rejected": "the sky is green."}, tokenizer
    )
    explicit = tokenize_preference(
        {"prompt": "the sky is", "chosen": " blue.", "rejected": " green."}, tokenizer
    )
    assert out == explicit


def test_the_detected_format_is_logged(tokenizer, caplog):
    rows = [{"prompt": "the sky is", "completion": " blue."}]
    with caplog.at_level(logging.INFO, logger="grimoire"):
        tokenize_dataset(rows, tokenize_sft, source_name="train", tokenizer=tokenizer)
    assert (
        "train: prompt-completion, standard format (columns ['completion', 'prompt'])"
        in caplog.text
    )
