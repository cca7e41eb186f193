"""Shared pieces of the tokenizers: field checks and chat rendering with assistant masks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError


def require_fields(example: Mapping[str, Any], fields: Sequence[str], fn: str) -> None:
    """Raise a DataError naming every missing or empty field of ``example``."""
    problems = []
    for name in fields:
        if name not in example:
            problems.append(
                f"{fn}: missing field {name!r}; the row has {sorted(example)} "
                f"(pass {fn}(..., {name.split('_')[0]}_field=...) to use another column)"
            )
        elif example[name] is None or (isinstance(example[name], str | list) and not example[name]):
            problems.append(f"{fn}: field {name!r} is empty")
    if problems:
        raise DataError(problems)


def render_chat(
    tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            [
                "the tokenizer has no chat_template; set tokenizer.chat_template or use prompt/response fields"
            ]
        )
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding regardless
        ids = ids["input_ids"]
    return list(ids)


def chat_with_assistant_mask(
    tokenizer, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """Render ``messages`` and return ``(input_ids, labels)`` with loss only on assistant turns.

    Works with any prefix-stable chat template (no ``{% generation %}`` tags needed): each
    assistant turn's tokens are the difference between the rendering up to and including that
    turn and the rendering of the conversation before it with the generation prompt.
    """
    full = render_chat(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(full)
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        start = len(render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        end_ids = render_chat(tokenizer, messages[: i + 1])
        if full[: len(end_ids)] != end_ids or start > len(end_ids):
            raise DataError(
                [
                    "the chat template is not prefix-stable, so assistant turns cannot be located; "
                    "use prompt/response fields or a template with stable prefixes"
                ]
            )
        labels[start : len(end_ids)] = full[start : len(end_ids)]
    return full, labels
