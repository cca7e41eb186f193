"""tokenize_sft and SFTCollator: label layouts worked out by hand on the character tokenizer."""

from __future__ import annotations

import pytest
import torch

from grimoire.data import SFTCollator, tokenize_sft
from grimoire.errors import DataError
from grimoire.rows.common import counting_cuts

IGNORE = -100


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_response_masks_prompt_and_trains_eos(tokenizer):
    out = tokenize_sft({"prompt": "ab=", "response": "ba"}, tokenizer)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert out["input_ids"] == [bos, *ids(tokenizer, "ab="), *ids(tokenizer, "ba"), eos]
    assert out["labels"] == [IGNORE] * 4 + [*ids(tokenizer, "ba"), eos]
    assert out["attention_mask"] == [1] * 7


def test_plain_text_trains_every_token(tokenizer):
    out = tokenize_sft({"text": "abc"}, tokenizer)
    assert out["labels"] == out["input_ids"]
    assert out["input_ids"][-1] == tokenizer.eos_token_id


def test_chat_messages_train_assistant_turns_only(tokenizer):
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "k"},
    ]
    out = tokenize_sft({"messages": messages}, tokenizer)
    text = tokenizer.decode(out["input_ids"])
    assert text.startswith("<bos><|system|>s<|end|><|user|>hi<|end|><|assistant|>yo<|end|>")
    trained = tokenizer.decode([t for t in out["labels"] if t != IGNORE])
    # Each assistant reply and its end-of-turn marker are trained; user/system text never is.
    # The template closes the last turn with <|end|>: the row is its rendering, no EOS after it.
    assert trained == "yo<|end|>k<|end|>"
    assert out["input_ids"] == ids(
        tokenizer, tokenizer.apply_chat_template(messages, tokenize=False)
    )


def test_long_rows_are_errors_unless_truncation_asks(tokenizer):
    row = {"prompt": "abcdefgh", "response": "xy"}  # bos + 8 + 2 + eos = 12 tokens
    with pytest.raises(DataError, match="the row has 12 tokens, more than max_length=11"):
        tokenize_sft(row, tokenizer, max_length=11)
    with counting_cuts() as cut:
        out = tokenize_sft(row, tokenizer, max_length=11, truncation="cut")
        assert tokenize_sft(row, tokenizer, max_length=11, truncation="drop") is None
    assert len(out["input_ids"]) == 11 and out["labels"][-2:] == ids(tokenizer, "xy")
    assert set(out) == {"input_ids", "attention_mask", "labels"}  # same columns as any row
    # The EOS is cut: the only turn loses its end; one more row was dropped whole.
    assert cut == {"rows": 1, "dropped": 1, "turns": 0, "tokens": 1, "open_turns": 1}
    with pytest.raises(DataError, match="no trainable tokens left after truncation"):
        tokenize_sft(row, tokenizer, max_length=5, truncation="cut")


def test_bad_rows_name_the_field(tokenizer):
    with pytest.raises(DataError, match="missing field 'response'"):
        tokenize_sft({"prompt": "a"}, tokenizer)
    with pytest.raises(DataError, match="field 'response' is empty"):
        tokenize_sft({"prompt": "a", "response": ""}, tokenizer)
    with pytest.raises(DataError, match="none of"):
        tokenize_sft({"question": "a"}, tokenizer)
    out = tokenize_sft({"q": "a", "a": "b"}, tokenizer, prompt_field="q", response_field="a")
    assert out["labels"][-2:] == [*ids(tokenizer, "b"), tokenizer.eos_token_id]


def test_collator_pads_right_with_masked_labels():
    batch = SFTCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["input_ids"].dtype == torch.long


def test_tiny_template_renders_tools_reasoning_and_tool_results(tokenizer):
    tools = [{"type": "function", "function": {"name": "rev", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "rev", "arguments": {"word": "ab"}}}
    messages = [
        {"role": "user", "content": "reverse ab="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "ba"},
        {"role": "assistant", "content": "ba", "reasoning_content": "the tool said ba"},
    ]
    out = tokenize_sft({"messages": messages, "tools": tools}, tokenizer)
    assert tokenizer.decode(out["input_ids"]) == (
        "<bos><|system|>tools: rev<|end|><|user|>reverse ab=<|end|>"
        "<|assistant|>call: rev(word=ab)<|end|><|user|>result: ba<|end|>"
        "<|assistant|>think: the tool said ba\nba<|end|>"
    )
    trained = tokenizer.decode([t for t in out["labels"] if t != IGNORE])
    assert trained == "call: rev(word=ab)<|end|>think: the tool said ba\nba<|end|>"


def test_an_open_final_turn_gets_a_trained_eos():
    # GLM-4-MoE's shape on the tiny tokenizer: a turn ends where the next header starts, so the
    # final answer is left open: EOS is appended (and trained) after the template's rendering,
    # for SFT and preference rows alike. The middle turn is closed by the next <|user|>.
    from grimoire.data import tokenize_preference
    from grimoire.model.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "k"},
    ]
    out = tokenize_sft({"messages": messages}, tok)
    rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert out["input_ids"] == [*rendered, tok.eos_token_id]
    assert tok.decode([t for t in out["labels"] if t != IGNORE]) == "yo<|user|>k<eos>"
    pref = tokenize_preference(
        {"prompt": messages[:1], "chosen": messages[1:2], "rejected": messages[3:]}, tok
    )
    assert tok.decode([t for t in pref["chosen_labels"] if t != IGNORE]) == "yo<eos>"
    assert tok.decode([t for t in pref["rejected_labels"] if t != IGNORE]) == "k<eos>"
