"""Shared pieces of the tokenizers: field checks, chat rendering to token ids, fitting rows to
``max_length`` (with the cuts counted and logged), and the detected data format logged."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.formats import detect_format
from grimoire.rows.rendering import render_text

logger = logging.getLogger(__name__)


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
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    text = render_text(tokenizer, messages, generation=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_CUTS: ContextVar[dict[str, int] | None] = ContextVar("grimoire_cuts", default=None)
_CUT_FIELDS = ("rows", "dropped", "turns", "tokens", "open_turns")


@contextmanager
def counting_cuts() -> Iterator[dict[str, int]]:
    """Collect what the tokenizers cut inside the block (``tokenize_dataset`` logs the totals).

    A side channel rather than a column, so a row's columns never depend on whether it was
    cut (``datasets.map`` needs every row to return the same keys)."""
    totals: dict[str, int] = dict.fromkeys(_CUT_FIELDS, 0)
    token = _CUTS.set(totals)
    try:
        yield totals
    finally:
        _CUTS.reset(token)


def report_cut(**counts: int) -> None:
    """Add one row's cut to the active :func:`counting_cuts` (a debug line outside one)."""
    totals = _CUTS.get()
    if totals is None:
        logger.debug("row cut to max_length: %s", counts)
        return
    for key, value in counts.items():
        totals[key] += value


#: ``truncation`` settings: a row longer than ``max_length`` is an error, is dropped, is cut
#: after its last whole assistant turn that fits, or is cut at ``max_length``.
TRUNCATIONS = ("error", "drop", "turn", "cut")


def fit_length(
    input_ids: list[int], labels: list[int], max_length: int, truncation: str, fn: str
) -> tuple[list[int], list[int]] | None:
    """``input_ids``/``labels`` fitted to ``max_length`` as ``truncation`` asks.

    Returns ``(ids, labels)``, or ``None`` for a dropped row; what was removed is counted with
    :func:`report_cut`. ``"turn"`` ends the row after its last assistant turn
    (a run of trained labels, closing token included) that fits, so no kept turn loses its end;
    ``"cut"`` may end inside a turn, and counts it in ``open_turns``.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"{fn}: truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")
    n = len(input_ids)
    if n <= max_length:
        return input_ids, labels
    if truncation == "error":
        raise DataError(
            [
                f"{fn}: the row has {n} tokens, more than max_length={max_length} (raise "
                "max_length, or set truncation='turn' / 'cut' / 'drop', or "
                "truncate_long_samples in the CLI)"
            ]
        )
    if truncation == "drop":
        report_cut(dropped=1)
        return None
    trained = [label != IGNORE_INDEX for label in labels]
    starts = [i for i in range(n) if trained[i] and (i == 0 or not trained[i - 1])]
    ends = [i + 1 for i in range(n) if trained[i] and (i + 1 == n or not trained[i + 1])]
    if truncation == "turn":
        keep = max((e for e in ends if e <= max_length), default=0)
        if not keep:
            raise DataError(
                [
                    f"{fn}: the row has {n} tokens and its first assistant turn does not fit in "
                    f"max_length={max_length} (raise max_length or use truncation='cut')"
                ]
            )
    else:
        keep = max_length
    report_cut(
        rows=1,
        turns=sum(s >= keep for s in starts),  # whole turns removed
        tokens=n - keep,
        open_turns=sum(s < keep < e for s, e in zip(starts, ends)),  # cut before their end
    )
    return input_ids[:keep], labels[:keep]


def log_cuts(source_name: str, cut: Mapping[str, int]) -> None:
    """Say what truncation removed from ``source_name`` (nothing is cut silently)."""
    if cut["dropped"]:
        logger.warning("%s: dropped %d rows longer than max_length", source_name, cut["dropped"])
    if cut["rows"]:
        logger.warning(
            "%s: cut %d rows to max_length: %d tokens and %d whole assistant turns removed, "
            "%d assistant turns cut before their end-of-turn token",
            source_name,
            cut["rows"],
            cut["tokens"],
            cut["turns"],
            cut["open_turns"],
        )


def log_format(source_name: str, row: Mapping[str, Any]) -> None:
    """Log which of TRL's dataset formats ``row`` (a dataset's first row) is in."""
    found = detect_format(row)
    logger.info("%s: %s format (columns %s)", source_name, found or "no TRL dataset", sorted(row))
