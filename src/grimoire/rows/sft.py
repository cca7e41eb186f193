"""SFT data: ``tokenize_sft`` (chat messages, prompt/completion, or plain text).

Its collator is :class:`grimoire.collate.sft.SFTCollator`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.chat import (
    append_eos,
    chat_tokens,
    check_messages,
    row_tools,
    split_conversation,
)
from grimoire.rows.common import fit_length, require_fields


def _chat_row(
    example: Mapping[str, Any],
    tokenizer,
    messages_field: str,
    tools: Sequence[Any] | None,
    train_final_reasoning: bool,
) -> tuple[list[int], list[int], bool]:
    messages = example[messages_field]
    problems = check_messages(messages, tools=tools, field=messages_field, fn="tokenize_sft")
    if not problems and messages[-1].get("role") != "assistant":
        problems.append(
            f"tokenize_sft: {messages_field!r} ends with a {messages[-1].get('role')!r} turn; an "
            "SFT conversation must end with the assistant turn it trains on"
        )
    if problems:
        raise DataError(problems)
    out = chat_tokens(
        tokenizer, list(messages), tools=tools, train_final_reasoning=train_final_reasoning
    )
    return out.input_ids, out.labels, out.open_end


def _prompt_completion(
    example: Mapping[str, Any],
    tokenizer,
    prompt_field: str,
    response_field: str,
    tools: Sequence[Any] | None,
    train_final_reasoning: bool,
    max_prompt_length: int | None,
) -> tuple[list[int], list[int], bool]:
    require_fields(example, [prompt_field, response_field], "tokenize_sft")
    prompt, response = example[prompt_field], example[response_field]
    if isinstance(prompt, list) or isinstance(response, list):
        # Conversational prompt-completion (TRL): one rendering, only the completion trained.
        prompt_msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if isinstance(response, str):
            response = [{"role": "assistant", "content": response}]
        problems = check_messages(prompt_msgs, tools=tools, field=prompt_field, fn="tokenize_sft")
        problems += check_messages(response, tools=tools, field=response_field, fn="tokenize_sft")
        if problems:
            raise DataError(problems)
        p_ids, r_ids, r_labels, needs_eos = split_conversation(
            tokenizer,
            list(prompt_msgs),
            list(response),
            tools=tools,
            train_final_reasoning=train_final_reasoning,
        )
    else:
        p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        r_labels, needs_eos = list(r_ids), True  # plain strings: EOS always (TRL's rule)
    if max_prompt_length is not None and len(p_ids) > max_prompt_length:
        p_ids = p_ids[len(p_ids) - max_prompt_length :]
    ids, labels = list(p_ids) + list(r_ids), [IGNORE_INDEX] * len(p_ids) + list(r_labels)
    return ids, labels, needs_eos


def tokenize_sft(
    example: Mapping[str, Any],
    tokenizer,
    max_length: int = 2048,
    prompt_field: str = "prompt",
    response_field: str = "response",
    text_field: str = "text",
    messages_field: str = "messages",
    max_prompt_length: int | None = None,
    truncation: str = "error",
    tools_field: str = "tools",
    tools: Sequence[Any] | None = None,
    train_final_reasoning: bool = True,
) -> dict[str, Any] | None:
    """Tokenize one SFT example; loss only on what the model should write (prompt tokens -100).

    Accepted shapes, checked in this order:

    - ``messages``: a chat rendered once with the tokenizer's chat template (``tools`` from the
      row's ``tools_field`` column or the ``tools`` argument handed to it); every assistant turn
      is trained (content, reasoning as the template writes it, tool calls, the turn's closing
      token), system/user/tool text never (:mod:`grimoire.rows.chat`). It must end with an
      assistant turn. ``train_final_reasoning=False`` leaves the last turn's reasoning
      untrained; earlier turns' reasoning is trained only where the template renders it.
    - ``prompt`` + ``response`` (or TRL's ``completion``): strings, or messages (TRL's
      conversational prompt-completion: only the completion is trained).
    - ``text``: every token trained.

    EOS, so the model learns to stop: non-conversational rows (``prompt`` + ``response``
    strings, ``text``) get EOS appended and trained unless they already end with it, as TRL
    does. A conversation (``messages``, or conversational prompt-completion) is trained exactly
    as its chat template renders it: no EOS after the template's own end of turn
    (``<|im_end|>``, ``<|eot_id|>``, ...; stopping there is the inference stack's job, as for
    TRL). Only where the template leaves the final assistant turn open, writing no closing
    after it (:func:`grimoire.rows.chat.final_turn_open`; GLM-4-MoE's stock template), is EOS
    appended and trained.

    ``max_prompt_length`` (prompt + response rows) first cuts a longer prompt to its LAST
    tokens. A row longer than ``max_length`` is a ``DataError`` unless ``truncation`` is
    ``"drop"`` (returns ``None``; ``tokenize_dataset`` skips and counts it), ``"turn"`` (ends
    after the last whole assistant turn that fits) or ``"cut"`` (cut at ``max_length``); what was
    cut is counted (:func:`grimoire.rows.common.counting_cuts`) and ``tokenize_dataset`` logs it.

    Returns ``{"input_ids", "attention_mask", "labels"}`` (lists of equal length).
    """
    tools = row_tools(example, tools_field, tools)
    if response_field == "response" and "response" not in example and "completion" in example:
        response_field = "completion"  # TRL's prompt-completion column
    if example.get(messages_field):
        input_ids, labels, needs_eos = _chat_row(
            example, tokenizer, messages_field, tools, train_final_reasoning
        )
    elif prompt_field in example or response_field in example:
        input_ids, labels, needs_eos = _prompt_completion(
            example,
            tokenizer,
            prompt_field,
            response_field,
            tools,
            train_final_reasoning,
            max_prompt_length,
        )
    elif text_field in example:
        require_fields(example, [text_field], "tokenize_sft")
        input_ids = list(tokenizer(example[text_field], add_special_tokens=True)["input_ids"])
        labels, needs_eos = list(input_ids), True
    else:
        raise DataError(
            [
                f"tokenize_sft: the row has none of {messages_field!r}, {prompt_field!r}+"
                f"{response_field!r} (or 'completion') or {text_field!r}; it has {sorted(example)} "
                "(pass prompt_field=/response_field=/text_field=/messages_field= to map columns)"
            ]
        )
    if needs_eos:
        input_ids, labels = append_eos(tokenizer, input_ids, labels)
    fitted = fit_length(input_ids, labels, max_length, truncation, "tokenize_sft")
    if fitted is None:
        return None
    input_ids, labels = fitted
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(
            [
                f"tokenize_sft: no trainable tokens left after truncation to max_length={max_length} "
                "(the prompt fills the whole context; raise max_length or shorten the prompt)"
            ]
        )
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}
