"""SFT data: ``tokenize_sft`` (prompt/response, plain text, or chat messages).

Its collator is :class:`grimoire.collate.sft.SFTCollator`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.common import chat_with_assistant_mask, require_fields


def tokenize_sft(
    example: Mapping[str, Any],
    tokenizer,
    max_length: int = 2048,
    prompt_field: str = "prompt",
    response_field: str = "response",
    text_field: str = "text",
    messages_field: str = "messages",
    max_prompt_length: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize one SFT example; loss only on the response (prompt tokens get label -100).

    Accepted shapes, checked in this order: ``messages`` (a chat list rendered with the
    tokenizer's chat template, loss on assistant turns only), ``prompt`` + ``response``, or a
    plain ``text`` (loss on every token). The EOS token is appended to the response (and to plain
    text) and is part of the loss, so the model learns to stop. Rows are truncated to
    ``max_length`` from the right; a row whose response is cut away entirely is an error.
    ``max_prompt_length`` (grimoire-rl's argument; prompt + response rows) first cuts a longer
    prompt to its LAST ``max_prompt_length`` tokens, so more of the response survives
    ``max_length`` (grimoire-rl kept the prompt's first tokens; the end is what the response
    answers, as in the preference tokenizers here and TRL).

    Returns ``{"input_ids", "attention_mask", "labels"}`` (lists of equal length).
    """
    eos = tokenizer.eos_token_id
    if example.get(messages_field):
        input_ids, labels = chat_with_assistant_mask(tokenizer, list(example[messages_field]))
        if eos is not None and input_ids and input_ids[-1] != eos:
            # Templates that end turns with their own marker still get EOS so generation stops.
            input_ids, labels = input_ids + [eos], labels + [eos]
    elif prompt_field in example or response_field in example:
        require_fields(example, [prompt_field, response_field], "tokenize_sft")
        prompt = tokenizer(example[prompt_field], add_special_tokens=True)["input_ids"]
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt = prompt[len(prompt) - max_prompt_length :]
        response = tokenizer(example[response_field], add_special_tokens=False)["input_ids"]
        response = response + ([eos] if eos is not None else [])
        input_ids = prompt + response
        labels = [IGNORE_INDEX] * len(prompt) + response
    elif text_field in example:
        require_fields(example, [text_field], "tokenize_sft")
        input_ids = tokenizer(example[text_field], add_special_tokens=True)["input_ids"]
        input_ids = input_ids + ([eos] if eos is not None else [])
        labels = list(input_ids)
    else:
        raise DataError(
            [
                f"tokenize_sft: the row has none of {messages_field!r}, {prompt_field!r}+"
                f"{response_field!r} or {text_field!r}; it has {sorted(example)} "
                "(pass prompt_field=/response_field=/text_field=/messages_field= to map columns)"
            ]
        )
    input_ids, labels = input_ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(
            [
                f"tokenize_sft: no trainable tokens left after truncation to max_length={max_length} "
                "(the prompt fills the whole context; raise max_length or shorten the prompt)"
            ]
        )
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}
