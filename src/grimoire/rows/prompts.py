"""Prompt-only data for online methods (GRPO, RLOO, Online DPO, RAFT).

``tokenize_grpo`` turns a row into prompt token ids and keeps every other column (``answer``,
test cases, ...) untouched, because reward functions receive them per completion.
:class:`grimoire.collate.prompts.GRPOCollator` collates them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grimoire.errors import DataError
from grimoire.rows.common import render_chat, require_fields

#: Columns ``tokenize_grpo`` writes itself; a dataset column with one of these names is replaced.
GRPO_COLUMNS = ("prompt_input_ids", "prompt_attention_mask", "prompt", "prompt_messages")


def tokenize_grpo(
    example: Mapping[str, Any],
    tokenizer,
    max_length: int = 2048,
    prompt_field: str = "prompt",
    max_prompt_length: int | None = None,
    metadata_fields: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Tokenize one prompt row for online RL.

    ``example[prompt_field]`` is a plain string (tokenized with the tokenizer's special tokens,
    e.g. BOS) or a chat message list (rendered with the chat template and the generation prompt,
    so the model answers as the assistant).

    Returns ``prompt_input_ids``, ``prompt_attention_mask``, ``prompt`` (the prompt as text: the
    string itself, or the rendered chat template; this is what reward functions receive as
    ``prompts``), for a chat prompt ``prompt_messages`` (its messages as given: what an agentic
    rollout's environment starts the episode from, not the rendered text) and every other
    column of ``example`` unchanged. A prompt longer than
    ``max_length`` is an error rather than truncated: cutting a prompt changes the task. (The
    method checks ``prompt + max_new_tokens`` against the context before training.)

    grimoire-rl's arguments: ``max_prompt_length`` asks for truncation instead: a longer prompt
    keeps its LAST ``max_prompt_length`` tokens (the question and the generation prompt sit at
    the end; grimoire-rl kept the first ones). ``metadata_fields`` keeps only those columns
    besides the prompt (default: all), and each must be present.
    """
    require_fields(example, [prompt_field], "tokenize_grpo")
    prompt = example[prompt_field]
    messages: list[dict[str, Any]] | None = None
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        text = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(m) for m in prompt]
        ids = render_chat(tokenizer, messages, add_generation_prompt=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        raise DataError(
            [
                f"tokenize_grpo: field {prompt_field!r} must be a string or a list of chat "
                f"messages ({{'role', 'content'}}), got {type(prompt).__name__}"
            ]
        )
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        ids = ids[-max_prompt_length:]
        text = tokenizer.decode(ids)  # what the model sees is what reward functions get
    if len(ids) > max_length:
        raise DataError(
            [
                f"tokenize_grpo: prompt has {len(ids)} tokens > max_length={max_length} "
                "(prompts are not truncated; shorten it or raise max_length)"
            ]
        )
    if metadata_fields is not None:
        require_fields(example, list(metadata_fields), "tokenize_grpo")
        keep = set(metadata_fields)
    else:
        keep = set(example)
    extras = {
        k: v
        for k, v in example.items()
        if k in keep and k != prompt_field and k not in GRPO_COLUMNS
    }
    out = {
        **extras,
        "prompt_input_ids": ids,
        "prompt_attention_mask": [1] * len(ids),
        "prompt": text,
    }
    if messages is not None:
        out["prompt_messages"] = messages
    return out


__all__ = ["GRPO_COLUMNS", "tokenize_grpo"]
