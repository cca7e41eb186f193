"""Pairwise preference data: ``tokenize_preference`` (collated by
:class:`grimoire.collate.preference.PreferenceCollator`).

A row is a prompt with a preferred (``chosen``) and a dispreferred (``rejected``) response, as
plain strings or as chat messages. Both responses share the prompt tokens exactly, so every
difference between the two sequences' log-probs comes from the responses. The helpers
``encode_prompt_response``, ``truncate_prompt_responses`` and ``tokenize_prompt_responses`` are
shared with the KTO tokenizer.

Truncation (when ``prompt + longest response > max_length``): the prompt is shortened first,
keeping its END (the question right before the answer matters most; a leading BOS token is kept),
but never below ``max_prompt_length`` tokens (default ``max_length // 2``); then the responses
keep their START. A cut response loses its end (EOS or end of turn), so the model is never
taught to stop where the text did not. A row left with no trainable response token raises
``DataError``. What is cut is counted (:func:`grimoire.rows.common.counting_cuts`;
``tokenize_dataset`` logs the totals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.chat import append_eos, check_messages, row_tools, split_conversation
from grimoire.rows.common import report_cut

Messages = list[dict[str, Any]]

#: Columns produced by :func:`tokenize_preference` (``PreferenceCollator`` pads them).
PREFERENCE_COLUMNS: tuple[str, ...] = (
    "chosen_input_ids",
    "chosen_attention_mask",
    "chosen_labels",
    "rejected_input_ids",
    "rejected_attention_mask",
    "rejected_labels",
)


# --------------------------------------------------------------------------- shared helpers


def _missing_or_empty(example: Mapping[str, Any], name: str, fn: str, kwarg: str) -> str | None:
    """A problem naming field ``name`` when it is absent, empty or blank, else None.

    ``kwarg`` is the tokenizer argument that maps the column (e.g. ``"chosen_field"``), so the
    message says how to point the tokenizer at a differently named column.
    """
    if name not in example:
        return (
            f"{fn}: missing field {name!r}; the row has {sorted(example)} "
            f"(pass {fn}(..., {kwarg}=...) to use another column)"
        )
    value = example[name]
    if value is None or (isinstance(value, str | list) and not value):
        return f"{fn}: field {name!r} is empty"
    if isinstance(value, str) and not value.strip():
        return f"{fn}: field {name!r} is only whitespace"
    return None


def _as_messages(value: Any, role: str, field: str, fn: str) -> Messages:
    """A chat-message list from a list of ``{"role", "content"}`` dicts or a bare string."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in value
    ):
        raise DataError(
            [
                f"{fn}: field {field!r} must be a string or a list of "
                f"{{'role', 'content'}} messages, got {type(value).__name__}"
            ]
        )
    return [dict(m) for m in value]


def encode_prompt_response(
    tokenizer,
    prompt: Any,
    response: Any,
    *,
    prompt_field: str,
    response_field: str,
    fn: str,
    conversational: bool,
    tools: Sequence[Any] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Tokenize one ``(prompt, response)``: ``(prompt_ids, response_ids, response_labels)``.

    Strings: ``prompt`` with the tokenizer's special tokens (BOS), the response without, plus
    EOS unless it already ends with it (trained, so the model learns to stop; TRL's rule).
    Conversational: ``prompt + response`` is rendered ONCE with the chat template (``tools``
    handed to it) and the response starts where its first assistant turn does
    (:func:`grimoire.rows.chat.split_conversation`); only its assistant turns are trained (tool
    calls included, tool results never), exactly as the template renders them: no EOS after
    the template's own end of turn, EOS appended only where the template leaves the final
    turn open (:func:`grimoire.rows.chat.final_turn_open`).
    """
    if not conversational:
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        response_ids, response_labels = append_eos(tokenizer, response_ids, response_ids)
        return list(prompt_ids), response_ids, response_labels
    prompt_msgs = _as_messages(prompt, "user", prompt_field, fn) if prompt else []
    response_msgs = _as_messages(response, "assistant", response_field, fn)
    if not any(m.get("role") == "assistant" for m in response_msgs):
        raise DataError([f"{fn}: field {response_field!r} has no assistant message to train on"])
    problems = check_messages(prompt_msgs, tools=tools, field=prompt_field, fn=fn)
    problems += check_messages(response_msgs, tools=tools, field=response_field, fn=fn)
    if problems:
        raise DataError(problems)
    prompt_ids, response_ids, response_labels, open_end = split_conversation(
        tokenizer, prompt_msgs, response_msgs, tools=tools
    )
    if open_end:
        response_ids, response_labels = append_eos(tokenizer, response_ids, response_labels)
    return prompt_ids, response_ids, response_labels


def truncate_prompt_responses(
    prompt_ids: list[int],
    responses: Sequence[tuple[list[int], list[int]]],
    max_length: int,
    max_prompt_length: int | None,
    bos_token_id: int | None,
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Fit ``prompt + each response`` into ``max_length`` (see the module docstring).

    ``responses`` are ``(ids, labels)`` pairs sharing ``prompt_ids``; the same prompt cut is
    applied to all of them, so paired responses keep an identical context.
    """
    floor = max_length // 2 if max_prompt_length is None else max_prompt_length
    longest = max(len(ids) for ids, _ in responses)
    if len(prompt_ids) + longest <= max_length:
        return prompt_ids, [(list(i), list(lab)) for i, lab in responses]
    keep = min(len(prompt_ids), max(max_length - longest, floor))
    if keep < len(prompt_ids):
        # Keep the end of the prompt (closest to the answer), and the BOS the model expects first.
        if bos_token_id is not None and prompt_ids and prompt_ids[0] == bos_token_id and keep > 1:
            prompt_ids = [bos_token_id, *prompt_ids[len(prompt_ids) - keep + 1 :]]
        else:
            prompt_ids = prompt_ids[len(prompt_ids) - keep :] if keep else []
    budget = max_length - len(prompt_ids)
    return prompt_ids, [(list(i[:budget]), list(lab[:budget])) for i, lab in responses]


def tokenize_prompt_responses(
    tokenizer,
    prompt: Any,
    responses: Sequence[tuple[str, Any]],
    *,
    prompt_field: str,
    fn: str,
    max_length: int,
    max_prompt_length: int | None,
    conversational: bool,
    tools: Sequence[Any] | None = None,
) -> list[dict[str, list[int]]]:
    """``prompt`` followed by each ``(field, response)``, truncated together: one
    ``{"input_ids", "attention_mask", "labels"}`` per response (prompt tokens labelled -100).

    The tokenization shared by :func:`tokenize_preference` (two responses) and
    :func:`grimoire.rows.kto.tokenize_kto` (one): :func:`encode_prompt_response` for each (the
    first response's prompt tokens are the shared prompt), :func:`truncate_prompt_responses`,
    then a ``DataError`` naming every response left with no trainable token.
    """
    encoded = [
        encode_prompt_response(
            tokenizer,
            prompt,
            response,
            prompt_field=prompt_field,
            response_field=field,
            fn=fn,
            conversational=conversational,
            tools=tools,
        )
        for field, response in responses
    ]
    if any(prompt_ids != encoded[0][0] for prompt_ids, _, _ in encoded):
        raise DataError(
            [
                f"{fn}: the chat template renders {prompt_field!r} differently before each "
                "response, so the responses would not share one prompt"
            ]
        )
    prompt_ids, cut = truncate_prompt_responses(
        encoded[0][0],
        [(ids, labels) for _, ids, labels in encoded],
        max_length,
        max_prompt_length,
        tokenizer.bos_token_id,
    )
    _check_trainable([field for field, _ in responses], cut, fn, max_length)
    _report_truncation(encoded, prompt_ids, cut)
    mask = [IGNORE_INDEX] * len(prompt_ids)
    return [
        {
            "input_ids": prompt_ids + ids,
            "attention_mask": [1] * (len(prompt_ids) + len(ids)),
            "labels": mask + labels,
        }
        for ids, labels in cut
    ]


def _check_trainable(
    fields: Sequence[str], cut: Sequence[tuple[list[int], list[int]]], fn: str, max_length: int
) -> None:
    """A :class:`DataError` naming every response truncation left with no trained token."""
    untrained = [f for f, (_, labels) in zip(fields, cut) if all(x == IGNORE_INDEX for x in labels)]
    if untrained:
        raise DataError(
            [
                f"{fn}: field {f!r} has no trainable token left after truncation to "
                f"max_length={max_length} (raise max_length or lower max_prompt_length)"
                for f in untrained
            ]
        )


def _report_truncation(
    encoded: Sequence[tuple[list[int], list[int], list[int]]],
    prompt_ids: list[int],
    cut: Sequence[tuple[list[int], list[int]]],
) -> None:
    """Count the tokens truncation removed from one row (prompt and responses) and the
    assistant turns it left open, so ``tokenize_dataset`` logs them: nothing is cut silently."""
    removed = open_turns = 0
    for (_, full_ids, full_labels), (ids, labels) in zip(encoded, cut):
        removed += len(encoded[0][0]) + len(full_ids) - len(prompt_ids) - len(ids)
        open_turns += len(labels) < len(full_labels) and full_labels[len(labels)] != IGNORE_INDEX
    if removed:
        report_cut(rows=1, tokens=removed, open_turns=open_turns)


def _check_lengths(max_length: int, max_prompt_length: int | None, fn: str) -> None:
    if max_length < 2:
        raise ValueError(f"{fn}: max_length must be >= 2, got {max_length}")
    if max_prompt_length is not None and not 0 <= max_prompt_length < max_length:
        raise ValueError(
            f"{fn}: max_prompt_length must be in [0, max_length={max_length}), "
            f"got {max_prompt_length}"
        )


def _is_conversational(*values: Any) -> bool:
    return any(isinstance(v, list) for v in values)


def split_implicit_prompt(
    chosen: Messages, rejected: Messages
) -> tuple[Messages, Messages, Messages]:
    """``(prompt, chosen_rest, rejected_rest)``: the shared leading messages are the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def split_implicit_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """``(prompt, chosen_rest, rejected_rest)`` of TRL's standard implicit-prompt rows: the
    shared leading text is the prompt, ending before the space that precedes the first
    difference (TRL's ``extract_prompt`` rule), so each response starts with its word."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if 0 < n < min(len(chosen), len(rejected)) + 1 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


# --------------------------------------------------------------------------- tokenize


def tokenize_preference(
    example: Mapping[str, Any],
    tokenizer,
    max_length: int = 2048,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    max_prompt_length: int | None = None,
    margin_field: str | None = None,
    tools_field: str = "tools",
    tools: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Tokenize one preference pair into chosen/rejected sequences sharing the prompt tokens.

    Accepted rows:

    - strings: ``prompt``, ``chosen``, ``rejected`` (EOS is appended to each response and
      trained, unless it already ends with it);
    - conversational: ``prompt`` a message list (or a string, read as one user message) and
      ``chosen``/``rejected`` message lists (or strings, read as one assistant message),
      rendered with the tokenizer's chat template; only assistant turns of the responses are
      trained, exactly as the template renders them (no EOS after its end of turn; EOS only
      where it leaves the final turn open, :func:`grimoire.rows.chat.final_turn_open`);
    - implicit prompt: no ``prompt`` field and ``chosen``/``rejected`` full conversations (their
      shared leading messages are the prompt) or full texts (their shared leading text, up to
      the space before the first difference, as TRL splits them).

    Conversations may carry assistant ``tool_calls`` (trained) and ``tool`` messages (never
    trained); the tool schemas come from the row's ``tools_field`` column or ``tools``.
    Over-long rows are truncated as the module docstring describes. ``margin_field`` copies a
    numeric per-pair margin (for ``RewardModelLoss(margin_field=...)``) into the output under
    the same name.

    Returns ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels`` and the three
    ``rejected_*`` columns (prompt tokens labelled -100).

    Raises:
        DataError: a missing or empty field (named), a malformed message list, identical chosen
            and rejected responses (no preference signal), or no trainable token left.
    """
    fn = "tokenize_preference"
    _check_lengths(max_length, max_prompt_length, fn)
    prompt, chosen, rejected = _pair_fields(example, prompt_field, chosen_field, rejected_field)
    chosen_row, rejected_row = tokenize_prompt_responses(
        tokenizer,
        prompt,
        [(chosen_field, chosen), (rejected_field, rejected)],
        prompt_field=prompt_field,
        fn=fn,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        conversational=_is_conversational(prompt, chosen, rejected),
        tools=row_tools(example, tools_field, tools),
    )
    if chosen_row["input_ids"] == rejected_row["input_ids"]:
        raise DataError(
            [
                f"{fn}: {chosen_field!r} and {rejected_field!r} are identical after truncation to "
                f"max_length={max_length}, so the pair carries no preference signal "
                "(raise max_length)"
            ]
        )
    out: dict[str, Any] = {
        f"{side}_{key}": value
        for side, row in (("chosen", chosen_row), ("rejected", rejected_row))
        for key, value in row.items()
    }
    if margin_field is not None:
        out[margin_field] = _margin(example, margin_field, fn)
    return out


def _pair_fields(
    example: Mapping[str, Any], prompt_field: str, chosen_field: str, rejected_field: str
) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a preference row: its fields, or for a row without a
    prompt, the prompt its two responses share (leading messages or text); every missing or
    empty field in one :class:`DataError`, and an error for identical responses."""
    fn = "tokenize_preference"
    problems = [
        p
        for f, kwarg in ((chosen_field, "chosen_field"), (rejected_field, "rejected_field"))
        if (p := _missing_or_empty(example, f, fn, kwarg))
    ]
    chosen, rejected = example.get(chosen_field), example.get(rejected_field)
    implicit = prompt_field not in example and (
        (isinstance(chosen, list) and isinstance(rejected, list))
        or (isinstance(chosen, str) and isinstance(rejected, str))
    )
    if not implicit and (p := _missing_or_empty(example, prompt_field, fn, "prompt_field")):
        problems.append(p)
    if problems:
        raise DataError(problems)
    if chosen == rejected:
        raise DataError(
            [
                f"{fn}: fields {chosen_field!r} and {rejected_field!r} are identical, so the pair "
                "carries no preference signal (drop the row)"
            ]
        )
    prompt: Any = example.get(prompt_field)
    if implicit and isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = split_implicit_text(chosen, rejected)
        if not prompt:
            raise DataError(
                [
                    f"{fn}: missing field {prompt_field!r}, and {chosen_field!r}/"
                    f"{rejected_field!r} share no leading text to use as an implicit prompt"
                ]
            )
    elif implicit:
        prompt, chosen, rejected = split_implicit_prompt(
            _as_messages(chosen, "assistant", chosen_field, fn),
            _as_messages(rejected, "assistant", rejected_field, fn),
        )
        if not prompt:
            raise DataError(
                [
                    f"{fn}: no {prompt_field!r} field and {chosen_field!r}/{rejected_field!r} share "
                    "no leading messages to use as the prompt"
                ]
            )
    return prompt, chosen, rejected


def _margin(example: Mapping[str, Any], margin_field: str, fn: str) -> float:
    """The pair's numeric margin (``RewardModelLoss(margin_field=...)``)."""
    value = example.get(margin_field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(
            [f"{fn}: field {margin_field!r} must be a number (the pair's margin), got {value!r}"]
        )
    return float(value)


__all__ = [
    "PREFERENCE_COLUMNS",
    "encode_prompt_response",
    "split_implicit_prompt",
    "split_implicit_text",
    "tokenize_preference",
    "tokenize_prompt_responses",
    "truncate_prompt_responses",
]
