"""Shared pieces of the tokenizers and collators: padding, truncation, chat rendering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grimoire.errors import DataError
from grimoire.forward.logprobs import IGNORE_INDEX


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


def pad_sequences(seqs: Sequence[Sequence[int]], value: int, side: str = "right") -> torch.Tensor:
    """Pad integer lists to the longest: ``[B, T]`` long tensor."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            if side == "right":
                out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            else:
                out[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
    return out


def collate_prefixed(
    features: Sequence[Mapping[str, Any]], pad_token_id: int, prefixes: Sequence[str] = ("",)
) -> dict[str, torch.Tensor]:
    """Right-pad ``{prefix}input_ids`` / ``labels`` / ``attention_mask`` for each prefix.

    Other numeric columns (e.g. cached reference log-probs) are stacked as tensors; strings are
    passed through as lists.
    """
    batch: dict[str, Any] = {}
    for p in prefixes:
        ids = [f[f"{p}input_ids"] for f in features]
        batch[f"{p}input_ids"] = pad_sequences(ids, pad_token_id)
        batch[f"{p}labels"] = pad_sequences([f[f"{p}labels"] for f in features], IGNORE_INDEX)
        if f"{p}position_ids" in features[0]:
            # Rows that carry their own document boundaries (pretrain blocks): no attention mask,
            # so attention follows position_ids; padding continues the last segment's positions
            # (causal attention keeps real tokens from seeing it, and its labels are -100).
            batch[f"{p}position_ids"] = torch.stack(
                [
                    _continue_positions(f[f"{p}position_ids"], batch[f"{p}input_ids"].shape[1])
                    for f in features
                ]
            )
        else:
            batch[f"{p}attention_mask"] = pad_sequences([[1] * len(s) for s in ids], 0)
    handled = {
        f"{p}{k}"
        for p in prefixes
        for k in ("input_ids", "labels", "attention_mask", "position_ids")
    }
    for key in features[0]:
        if key in handled:
            continue
        values = [f[key] for f in features]
        if all(isinstance(v, bool | int | float) for v in values):
            batch[key] = torch.tensor(values)
        else:
            batch[key] = values
    return batch


def _continue_positions(pos: Sequence[int], width: int) -> torch.Tensor:
    out = torch.as_tensor(list(pos), dtype=torch.long)
    if len(out) < width:
        last = int(out[-1]) if len(out) else -1
        out = torch.cat([out, torch.arange(last + 1, last + 1 + width - len(out))])
    return out


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
