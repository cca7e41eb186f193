"""Prompt data for online methods: tokenize_grpo and GRPOCollator."""

from __future__ import annotations

import pytest

from grimoire.collate.prompts import GRPOCollator, prompt_token_lists
from grimoire.errors import DataError
from grimoire.rows.prompts import tokenize_grpo


def test_plain_prompt_keeps_extra_columns(tokenizer):
    row = {"prompt": "reverse abc=", "answer": "cba", "meta": {"k": 1}}
    out = tokenize_grpo(row, tokenizer, max_length=64)
    assert out["prompt_input_ids"] == tokenizer("reverse abc=")["input_ids"]
    assert out["prompt_input_ids"][0] == tokenizer.bos_token_id
    assert out["prompt_attention_mask"] == [1] * len(out["prompt_input_ids"])
    assert out["prompt"] == "reverse abc=" and out["answer"] == "cba" and out["meta"] == {"k": 1}


def test_chat_prompt_gets_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "reverse ab="}]
    out = tokenize_grpo({"messages": messages, "answer": "ba"}, tokenizer, 64, "messages")
    assert out["prompt"] == "<bos><|user|>reverse ab=<|end|><|assistant|>"
    assert tokenizer.decode(out["prompt_input_ids"]) == out["prompt"]
    assert "messages" not in out and out["answer"] == "ba"


def test_bad_rows(tokenizer):
    with pytest.raises(DataError, match="missing field 'prompt'"):
        tokenize_grpo({"question": "x"}, tokenizer, 64)
    with pytest.raises(DataError, match="prompts are not truncated"):
        tokenize_grpo({"prompt": "reverse abcdefgh="}, tokenizer, max_length=5)
    with pytest.raises(DataError, match="string or a list of chat messages"):
        tokenize_grpo({"prompt": 3}, tokenizer, 64)


def test_collator_left_pads_and_passes_columns(tokenizer):
    rows = [
        tokenize_grpo({"prompt": p, "answer": a}, tokenizer, 64)
        for p, a in (("reverse abc=", "cba"), ("hi", "x"))
    ]
    batch = GRPOCollator(pad_token_id=0)(rows)
    ids, mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
    n0, n1 = len(rows[0]["prompt_input_ids"]), len(rows[1]["prompt_input_ids"])
    assert ids.shape == (2, n0)
    assert ids[1].tolist() == [0] * (n0 - n1) + rows[1]["prompt_input_ids"]
    assert mask[1].tolist() == [0] * (n0 - n1) + [1] * n1
    assert batch["answer"] == ["cba", "x"] and batch["prompt"] == ["reverse abc=", "hi"]
    assert prompt_token_lists(batch) == [r["prompt_input_ids"] for r in rows]
