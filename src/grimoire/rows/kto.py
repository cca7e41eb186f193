"""KTO data: unpaired ``(prompt, completion, label)`` rows, and mismatched pairs for the KL term.

KTO's reference point ``z0`` estimates ``KL(pi || pi_ref)`` on MISMATCHED pairs: each prompt
with another row's completion (Ethayarajh et al., arXiv 2402.01306, section 4.1). The
``KTOCollator`` builds them inside each batch, pairing prompt ``i`` with completion
``(i + 1) mod B``; when the rows already carry ``kl_*`` columns (written by
:func:`grimoire.forward.precomputed.cache_reference_log_probs`, which fixes the pairs at dataset level so
their reference log-probs can be cached) it uses those instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grimoire.collate.packing import pack_row_sides
from grimoire.errors import DataError
from grimoire.forward.logprobs import IGNORE_INDEX
from grimoire.rows.common import collate_prefixed
from grimoire.rows.preference import (
    _check_lengths,
    _is_conversational,
    _missing_or_empty,
    tokenize_prompt_responses,
)

#: Columns produced by :func:`tokenize_kto`.
KTO_COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "labels", "label")


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
) -> dict[str, Any]:
    """Tokenize one unpaired KTO example: ``input_ids``, ``attention_mask``, ``labels``, ``label``.

    ``prompt``/``completion`` are strings or chat messages exactly as in
    :func:`grimoire.rows.preference.tokenize_preference` (EOS appended to the completion and
    trained; the same truncation: prompt end first, then completion start). ``label`` is a bool
    (True = desirable); 0/1 integers are accepted. grimoire-rl's rows name the completion
    ``response``: it is read when the row has no ``completion`` (or pass ``response_field=``).

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


@dataclass
class KTOCollator:
    """Pads KTO rows and adds the mismatched KL pairs ``kl_input_ids/kl_attention_mask/kl_labels``.

    In-batch pairs join prompt ``i`` with completion ``(i + 1) mod B``. With ``B == 1`` that is
    the row's own completion (the KL estimate then equals the implied reward): train KTO with a
    per-device batch size of at least 2, or cache the pairs at dataset level. Rows that already
    hold ``kl_input_ids``/``kl_labels`` (cached pairs) keep them. ``max_length`` (the trainer's
    ``max_length``, set by ``KTOLoss.setup`` when left None) bounds a pair's length.
    """

    pad_token_id: int
    max_length: int | None = None

    def with_kl_pairs(self, features: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The rows with their mismatched pair as ``kl_input_ids/kl_attention_mask/kl_labels``.

        Shared by the padded and the packed collator so both train on the very same pairs.
        """
        if not features:
            raise ValueError(f"{type(self).__name__} got an empty batch")
        if "kl_input_ids" in features[0]:
            rows = [dict(f) for f in features]
            for r in rows:
                r.setdefault("kl_attention_mask", [1] * len(r["kl_input_ids"]))
            return rows
        n = len(features)
        rows = []
        for i, f in enumerate(features):
            kl_ids, kl_labels = mismatched_pair(f, features[(i + 1) % n], self.max_length)
            rows.append(
                {
                    **f,
                    "kl_input_ids": kl_ids,
                    "kl_attention_mask": [1] * len(kl_ids),
                    "kl_labels": kl_labels,
                }
            )
        return rows

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = collate_prefixed(self.with_kl_pairs(features), self.pad_token_id, ("", "kl_"))
        if "label" in batch:
            batch["label"] = torch.as_tensor(batch["label"]).bool()
        return batch


#: Token columns a packed KTO batch replaces by its packed row (the rest ride along per row).
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclass
class PackedKTOCollator(KTOCollator):
    """Padding-free KTO: one ``[1, L]`` row holding the ``B`` completions, then their ``B``
    mismatched KL pairs (samples ``B .. 2B-1``; the same pairs :class:`KTOCollator` builds).

    Output: :func:`grimoire.collate.packing.pack_samples`' keys (``input_ids``, ``labels``,
    ``position_ids``, ``seq_lens [2B]``, ``sample_index``) plus every other per-row column
    (``label`` as bool, cached ``ref_logps``/``ref_kl_logps`` as tensors; non-numeric ones, e.g.
    ``ref_logps_reduction``, as lists). A subclass of :class:`KTOCollator` so that
    ``KTOLoss.setup`` bounds its pairs with the trainer's ``max_length`` the same way.
    """

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = pack_row_sides(
            self.with_kl_pairs(features),
            ("", "kl_"),
            self.pad_token_id,
            lambda key: key in _TOKEN_COLUMNS or key.startswith("kl_"),
        )
        if "label" in batch:
            batch["label"] = torch.as_tensor(batch["label"]).bool()
        return batch


__all__ = [
    "KTO_COLUMNS",
    "KTOCollator",
    "PackedKTOCollator",
    "mismatched_pair",
    "split_prompt_completion",
    "tokenize_kto",
]
