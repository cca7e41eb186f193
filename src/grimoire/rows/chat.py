"""Assistant-only labels from ONE rendering of a whole conversation.

The conversation is rendered once with the tokenizer's chat template (``tools`` handed to it)
and tokenized once. Each assistant message's span is then located in that text:

- a template with ``{% generation %}`` blocks (a "training" template): the span is exactly what
  transformers marks (``return_assistant_tokens_mask=True``), so the labels equal its mask;
- any other template: the message's content (after the template's own ``strip`` and its
  ``</think>`` split), or its first tool call's name when it has no content, is found in the
  text after the previous message; the span starts right after the template's assistant header
  (the generation prompt, learnt once per template from a tiny probe rendering) and ends after
  the turn's closing text (``<|im_end|>``, ``<|eot_id|>``, ...; learnt from the same probe).
  Everything the template writes in between (reasoning, tool calls) is the assistant's. A turn
  of tool calls is closed after its calls' names and argument values, so a tool result that
  repeats an argument is not found inside the call.

Tokens are labelled when they overlap a span (the fast tokenizer's offsets), so
nothing depends on earlier turns rendering the same way in a longer conversation: templates
that drop earlier reasoning, date-stamp the system turn or change the generation prompt work.
A message that cannot be located is a ``DataError`` naming it, never a silent guess.

A conversation is trained exactly as its template renders it: no EOS follows a template's own
end of turn (``<|im_end|>``, ``<|eot_id|>``, ...). The tokenizers append a trained EOS
(:func:`append_eos`) to a chat row only where the template leaves the final assistant turn open
(:func:`final_turn_open`: it writes no closing after it), so the model still learns to stop.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.rendering import render_text, template_shape

Messages = list[dict[str, Any]]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def has_generation_blocks(template: str | None) -> bool:
    """True when ``template`` marks assistant output with ``{% generation %}`` blocks."""
    return bool(template) and _GENERATION_TAG.search(template) is not None


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # multimodal parts: the text parts, as templates join them
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def answer_and_reasoning(message: Mapping[str, Any]) -> tuple[str, str]:
    """``(answer, reasoning)`` of an assistant message: ``reasoning_content``, or the
    ``<think>...</think>`` block at the start of ``content``."""
    content = _content_text(message)
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if "</think>" in content:
        think, content = content.rsplit("</think>", 1)
        reasoning = reasoning or think.replace("<think>", "")
    return content.strip(), str(reasoning).strip()


def _anchor(message: Mapping[str, Any]) -> str:
    answer, _ = answer_and_reasoning(message)
    if answer:
        return answer
    for call in message.get("tool_calls") or ():
        name = (call.get("function") or call).get("name") if isinstance(call, Mapping) else None
        if name:
            return str(name)
    return ""


_SPECIALS: dict[tuple[str, ...], re.Pattern[str] | None] = {}


def _specials_pattern(tokenizer) -> re.Pattern[str] | None:
    """One regex matching the tokenizer's added tokens (cached per token set)."""
    key = tuple(sorted(tokenizer.get_added_vocab(), key=len, reverse=True))
    if key not in _SPECIALS:
        _SPECIALS[key] = re.compile("|".join(map(re.escape, key))) if key else None
    return _SPECIALS[key]


class _Finder:
    """``str.find`` that skips matches inside the tokenizer's added tokens, so an answer "a"
    is never found inside ``<|assistant|>``."""

    def __init__(self, tokenizer, text: str):
        pattern = _specials_pattern(tokenizer)
        self.text = text
        self.inside = [False] * (len(text) + 1)
        for m in pattern.finditer(text) if pattern else ():
            for c in range(m.start() + 1, m.end()):
                self.inside[c] = True

    def find(self, needle: str, start: int, stop: int | None = None) -> int:
        if not needle:
            return -1
        at = self.text.find(needle, start, stop)
        while at >= 0 and (self.inside[at] or self.inside[at + len(needle)]):
            at = self.text.find(needle, at + 1, stop)
        return at


def assistant_spans(
    tokenizer, text: str, messages: Messages, *, train_final_reasoning: bool = True
) -> list[tuple[int, int]]:
    """Character spans of ``text`` to label: each assistant turn, located after the previous
    message (see the module docstring). Raises ``DataError`` naming a turn it cannot place."""
    shape = template_shape(tokenizer)
    finder = _Finder(tokenizer, text)
    spans: list[tuple[int, int]] = []
    cursor = 0
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for i, message in enumerate(messages):
        anchor = _anchor(message)
        if message.get("role") != "assistant":
            at = finder.find(anchor, cursor)
            if at >= 0:  # a template may drop or move a system turn; then nothing moves
                cursor = at + len(anchor)
            continue
        start = cursor
        head = text.find(shape.header[: shape.header_min], cursor) if shape.header_min else -1
        first = finder.find(anchor, cursor)
        if head < 0 or 0 <= first < head:
            start = head = -1  # no header of its own (Gemma 4 answers in the tool call's turn)
        if head >= 0:  # the earliest header after the previous message, as much of it as is there
            k = shape.header_min
            while k < len(shape.header) and text.startswith(shape.header[: k + 1], head):
                k += 1
            start = head + k
        at = finder.find(anchor, start) if start >= 0 else first
        start = at if start < 0 else start
        if at < 0:
            raise DataError(
                [
                    f"message {i} (assistant): its text {anchor[:40]!r} is not in the chat "
                    "template's rendering, so its tokens cannot be located"
                ]
            )
        after = at + len(anchor)
        closings = shape.closings + (shape.tool_closings if message.get("tool_calls") else ())
        after = _past_call_arguments(finder, text, message, after, closings)
        ends = [(p, c) for c in closings if (p := text.find(c, after)) >= 0]
        bound = _next_anchor(finder, messages, i, after)
        ends = [(p, c) for p, c in ends if bound < 0 or p < bound]
        if ends:
            pos, closing = min(ends)
            end = pos + len(closing)
        elif i == len(messages) - 1 and not text[after:].strip():
            end = len(text)  # the template writes nothing after a final answer
        else:
            raise DataError(
                [
                    f"message {i} (assistant): the end of its turn (one of "
                    f"{list(closings)}) is not in the chat template's rendering"
                ]
            )
        if i == last and not train_final_reasoning:
            start = max(start, at)  # the reasoning sits between the header and the answer
        spans.append((start, end))
        cursor = end
    return spans


def _past_call_arguments(
    finder: _Finder, text: str, message: Mapping[str, Any], after: int, closings: Sequence[str]
) -> int:
    """``after`` moved past the rendered names and scalar argument values of the turn's calls
    (those found, in order, before its first closing), so that a next message repeating one of
    them (a tool answering ``3`` to ``add(a=3, b=0)``) is not found inside the call."""
    for call in message.get("tool_calls") or ():
        function = call.get("function") or call if isinstance(call, Mapping) else {}
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        values = list(arguments.values()) if isinstance(arguments, Mapping) else []
        texts = [str(function.get("name") or "")] if isinstance(function, Mapping) else []
        texts += [str(v) for v in values if isinstance(v, str | int | float) and str(v)]
        for needle in filter(None, texts):
            ends = [p for c in closings if (p := text.find(c, after)) >= 0]
            at = finder.find(needle, after, min(ends) if ends else None)
            if at >= 0:
                after = at + len(needle)
    return after


def _next_anchor(finder: _Finder, messages: Messages, i: int, after: int) -> int:
    for message in messages[i + 1 :]:
        at = finder.find(_anchor(message), after)
        if at >= 0:
            return at
    return -1


def check_messages(messages: Any, *, tools: Sequence[Any] | None, field: str, fn: str) -> list[str]:
    """Problems of a message list: roles, empty assistant turns, tool calls without tools."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        return [f"{fn}: field {field!r} must be a list of {{'role', 'content'}} messages"]
    problems = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            problems.append(
                f"{fn}: {field}[{i}] has unknown role {role!r} (expected one of {list(_ROLES)})"
            )
        elif role == "assistant" and not _anchor(m):
            problems.append(
                f"{fn}: {field}[{i}] is an empty assistant turn (no content, no tool_calls)"
            )
        if m.get("tool_calls") and not tools:
            problems.append(
                f"{fn}: {field}[{i}] has tool_calls but the row has no 'tools' (add a 'tools' "
                "column with the tools' JSON schemas, or pass tools=...)"
            )
    return problems


@dataclass(frozen=True)
class ChatTokens:
    """One rendering of a conversation: token ids, labels (-100 outside assistant turns), the
    token index where each assistant turn's labelled span begins, and whether the template
    leaves the final assistant turn open (:func:`final_turn_open`)."""

    input_ids: list[int]
    labels: list[int]
    turn_starts: list[int]
    open_end: bool = False


def final_turn_open(tokenizer, text: str, messages: Messages) -> bool:
    """True when the template leaves the conversation's final turn open: the last message is
    the assistant's and nothing the template writes after its content (and its tool calls'
    arguments) closes a turn.

    What closes a turn is the tokenizer's EOS text or a text the template ends assistant turns
    with (:func:`grimoire.rows.rendering.template_shape`, learnt from probe renderings: the
    same closings the labelled spans end with; for a turn of tool calls also the tool-call
    closings, gpt-oss ``<|call|>``). So ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``
    close a turn; GLM-4-MoE's stock template, which writes nothing after the final answer (the
    next turn's ``<|user|>`` would end it), leaves it open. A conversation that ends with a
    non-assistant message is never open: its end is not the assistant's to learn."""
    if not messages or messages[-1].get("role") != "assistant":
        return False
    shape = template_shape(tokenizer)
    finder, cursor, after = _Finder(tokenizer, text), 0, -1
    for i, message in enumerate(messages):
        at = finder.find(_anchor(message), cursor)
        if at >= 0:
            cursor = at + len(_anchor(message))
            after = cursor if i == len(messages) - 1 else after
    if after < 0:
        return False  # the final answer is not placed (the labelling refuses such a row)
    last = messages[-1]
    closings = shape.closings + (shape.tool_closings if last.get("tool_calls") else ())
    after = _past_call_arguments(finder, text, last, after, closings)
    tail = text[after:]
    eos = getattr(tokenizer, "eos_token", None)
    return not any(c and c in tail for c in (*closings, eos))


def _check_rendered(tokenizer, text: str, messages: Messages) -> None:
    finder, cursor = _Finder(tokenizer, text), 0
    for i, message in enumerate(messages):
        anchor = _anchor(message)
        at = finder.find(anchor, cursor)
        if at >= 0:
            cursor = at + len(anchor)
        elif message.get("role") == "assistant":
            raise DataError(
                [
                    f"message {i} (assistant): its text {anchor[:40]!r} is not in the chat "
                    "template's rendering (the template drops it), so it cannot be trained"
                ]
            )


def chat_tokens(
    tokenizer,
    messages: Messages,
    *,
    tools: Sequence[Any] | None = None,
    train_final_reasoning: bool = True,
) -> ChatTokens:
    """Render ``messages`` once and label the assistant turns (see the module docstring)."""
    template = tokenizer.chat_template
    text = render_text(tokenizer, messages, tools=tools)
    if has_generation_blocks(template) and train_final_reasoning:
        _check_rendered(tokenizer, text, messages)
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        starts = [j for j, on in enumerate(mask) if on and (j == 0 or not mask[j - 1])]
        labels = [t if on else IGNORE_INDEX for t, on in zip(ids, mask)]
        return ChatTokens(ids, labels, starts, final_turn_open(tokenizer, text, messages))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    spans = assistant_spans(tokenizer, text, messages, train_final_reasoning=train_final_reasoning)
    labels = [IGNORE_INDEX] * len(ids)
    starts: list[int] = []
    # A token is labelled when it overlaps a span (as transformers' mask marks every token that
    # holds a character of a {% generation %} block), so a token merging the header's last
    # character with the answer's first keeps the answer trained.
    offsets = enc["offset_mapping"]
    firsts, lasts = [b for b, _ in offsets], [e for _, e in offsets]
    for begin, end in spans:
        j0, j1 = bisect_right(lasts, begin), bisect_left(firsts, end)
        labels[j0:j1] = ids[j0:j1]
        starts.append(j0)
    return ChatTokens(ids, labels, starts, final_turn_open(tokenizer, text, messages))


def chat_labels(
    tokenizer,
    messages: Messages,
    *,
    tools: Sequence[Any] | None = None,
    train_final_reasoning: bool = True,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one rendering of ``messages`` (:func:`chat_tokens`)."""
    out = chat_tokens(tokenizer, messages, tools=tools, train_final_reasoning=train_final_reasoning)
    return out.input_ids, out.labels


def row_tools(example: Mapping[str, Any], field: str, default: Sequence[Any] | None) -> list | None:
    """The tool schemas for one row: its ``field`` column (a list, or a JSON string of one),
    else the dataset-wide ``default``."""
    value = example.get(field, default)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError([f"field {field!r} is not valid JSON: {exc.msg}"]) from exc
    if value is not None and not isinstance(value, list):
        raise DataError([f"field {field!r} must be a list of tool JSON schemas"])
    return value or None


def append_eos(tokenizer, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """``ids``/``labels`` with the tokenizer's EOS appended and trained, unless they already end
    with it (or the tokenizer has none)."""
    eos = tokenizer.eos_token_id
    if eos is None or (ids and ids[-1] == eos):
        return list(ids), list(labels)
    return [*ids, eos], [*labels, eos]


def split_conversation(
    tokenizer,
    prompt: Messages,
    response: Messages,
    *,
    tools: Sequence[Any] | None = None,
    train_final_reasoning: bool = True,
) -> tuple[list[int], list[int], list[int], bool]:
    """``(prompt_ids, response_ids, response_labels, open_end)`` from ONE rendering of
    ``prompt + response``: the response starts where its first assistant turn's labels start;
    assistant turns inside ``prompt`` are context, never trained. ``open_end``: the template
    leaves the final turn open (:func:`final_turn_open`)."""
    out = chat_tokens(
        tokenizer, prompt + response, tools=tools, train_final_reasoning=train_final_reasoning
    )
    before = sum(m.get("role") == "assistant" for m in prompt)
    wanted = before + sum(m.get("role") == "assistant" for m in response)
    if wanted == before or len(out.turn_starts) != wanted:
        raise DataError(
            [
                f"the chat template's rendering has {len(out.turn_starts)} assistant spans for "
                f"{wanted} assistant messages, so the response cannot be located"
            ]
        )
    cut = out.turn_starts[before]
    return out.input_ids[:cut], out.input_ids[cut:], out.labels[cut:], out.open_end


__all__ = [
    "ChatTokens",
    "answer_and_reasoning",
    "append_eos",
    "assistant_spans",
    "chat_labels",
    "chat_tokens",
    "check_messages",
    "final_turn_open",
    "has_generation_blocks",
    "row_tools",
    "split_conversation",
]
