"""KTO data: unpaired ``(prompt, completion, label)`` rows, and mismatched pairs for the KL term.

KTO's reference point ``z0`` estimates ``KL(pi || pi_ref)`` on MISMATCHED pairs: each prompt
with another row's completion (Ethayarajh et al., arXiv 2402.01306, section 4.1).
:class:`grimoire.collate.kto.KTOCollator` builds them inside each batch with
:func:`mismatched_pair`, pairing prompt ``i`` with completion ``(i + 1) mod B``; when the rows
already carry ``kl_*`` columns (written by
:func:`grimoire.forward.precomputed.cache_reference_log_probs`, which fixes the pairs at dataset
level so their reference log-probs can be cached) it uses those instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.chat import row_tools
from grimoire.rows.preference import (
    _check_lengths,
    _is_conversational,
    _missing_or_empty,
    tokenize_prompt_responses,
)

#: Columns produced by :func:`tokenize_kto`.
KTO_COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "labels", "label")
#: grimoire-rl's ``tokenize_kto`` writes the label under this name; rows that carry it (and no
#: ``label``) are read the same (:func:`label_column`, :func:`with_label`).
PEER_LABEL_COLUMN = "kto_label"


def label_column(names: Iterable[str]) -> str:
    """The column holding a KTO row's label: ``label``, else grimoire-rl's ``kto_label`` when the
    rows have it, else ``label`` (then reported missing)."""
    names = set(names)
    return PEER_LABEL_COLUMN if "label" not in names and PEER_LABEL_COLUMN in names else "label"


def with_label(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` with grimoire-rl's ``kto_label`` renamed to ``label`` (unchanged without it)."""
    if label_column(row) == "label":
        return dict(row)
    out = {k: v for k, v in row.items() if k != PEER_LABEL_COLUMN}
    out["label"] = row[PEER_LABEL_COLUMN]
    return out


def _as_label(value: Any, field: str, fn: str) -> bool:
    # Accept bools and 0/1 ints (common in JSONL exports); anything else is ambiguous.
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise DataError(
        [
            f"{fn}: field {field!r} must be a bool (True = desirable, False = undesirable) or "
            f"0/1, got {value!r}"
        ]
    )


def tokenize_kto(
    example: Mapping[str, Any],
    tokenizer,
    max_length: int = 2048,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    label_field: str = "label",
    max_prompt_length: int | None = None,
    response_field: str | None = None,
    tools_field: str = "tools",
    tools: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Tokenize one unpaired KTO example: ``input_ids``, ``attention_mask``, ``labels``, ``label``.

    ``prompt``/``completion`` are strings or chat messages exactly as in
    :func:`grimoire.rows.preference.tokenize_preference` (EOS appended to a string completion
    and trained; a conversation trained as its template renders it, EOS only where the template
    leaves the final turn open; the same truncation: prompt end first, then completion start).
    ``label`` is a bool (True = desirable); 0/1 integers are accepted. grimoire-rl's rows name
    the completion ``response``: it is read when the row has no ``completion`` (or pass
    ``response_field=``). Conversations may carry tool calls; the schemas come from
    ``tools_field`` or ``tools``.

    Raises:
        DataError: a missing/empty prompt or completion, a missing or non-boolean label, or no
            trainable token left after truncation.
    """
    fn = "tokenize_kto"
    _check_lengths(max_length, max_prompt_length, fn)
    if response_field is not None:  # grimoire-rl's name for the completion column
        completion_field = response_field
    elif completion_field == "completion" and "completion" not in example and "response" in example:
        completion_field = "response"  # grimoire-rl's (and SFT's) default column name
    problems = [
        p
        for f, kwarg in (
            (prompt_field, "prompt_field"),
            (completion_field, "completion_field"),
        )
        if (p := _missing_or_empty(example, f, fn, kwarg))
    ]
    if label_field not in example or example[label_field] is None:
        problems.append(
            f"{fn}: missing field {label_field!r} (True = desirable, False = undesirable); the "
            f"row has {sorted(example)} (pass {fn}(..., label_field=...) to use another column)"
        )
    if problems:
        raise DataError(problems)
    label = _as_label(example[label_field], label_field, fn)
    prompt, completion = example[prompt_field], example[completion_field]
    [row] = tokenize_prompt_responses(
        tokenizer,
        prompt,
        [(completion_field, completion)],
        prompt_field=prompt_field,
        fn=fn,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        conversational=_is_conversational(prompt, completion),
        tools=row_tools(example, tools_field, tools),
    )
    return {**row, "label": label}


def split_prompt_completion(
    input_ids: Sequence[int], labels: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, completion_ids, completion_labels)``: the prompt ends at the first trained
    label (what :func:`tokenize_kto` produces)."""
    start = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
    return list(input_ids[:start]), list(input_ids[start:]), list(labels[start:])


def mismatched_pair(
    prompt_row: Mapping[str, Any], completion_row: Mapping[str, Any], max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``: ``prompt_row``'s prompt followed by ``completion_row``'s completion.

    With ``max_length``, an over-long pair keeps the whole prompt and cuts the completion's end
    (at least one completion token is kept).
    """
    p_ids, _, _ = split_prompt_completion(prompt_row["input_ids"], prompt_row["labels"])
    _, c_ids, c_labels = split_prompt_completion(
        completion_row["input_ids"], completion_row["labels"]
    )
    if max_length is not None:
        room = max(max_length - len(p_ids), 1)
        c_ids, c_labels = c_ids[:room], c_labels[:room]
    return p_ids + c_ids, [IGNORE_INDEX] * len(p_ids) + c_labels


__all__ = [
    "KTO_COLUMNS",
    "PEER_LABEL_COLUMN",
    "label_column",
    "mismatched_pair",
    "split_prompt_completion",
    "tokenize_kto",
    "with_label",
]
