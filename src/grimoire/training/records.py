"""The one reader of a run's ``metrics.jsonl`` (the trainer's log: one JSON object a line).

Used by the run summary and model card (:mod:`grimoire.training.report`), the CLI's end-of-run
summary and ``grimoire plot``, so all of them agree on what a readable record is. Standard
library only: ``grimoire plot`` reads runs without loading torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def metrics_path(output_dir: str | Path) -> Path:
    """``output_dir/metrics.jsonl``."""
    return Path(output_dir) / METRICS_FILE


def parse_records(
    text: str, source: str | Path, warnings: list[str] | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each JSON-object line of ``text`` (read from ``source``).

    Blank lines are skipped. A line that is not JSON is skipped with a warning appended to
    ``warnings`` (when given) naming ``source`` and line, except the last line without a
    newline: the trainer may still be writing it, or a crash cut it short. A JSON value that is
    not an object is skipped with a warning too.
    """
    lines = text.split("\n")
    records: list[tuple[int, dict[str, Any]]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if warnings is not None and lineno != len(lines):
                warnings.append(f"{source}:{lineno}: not valid JSON; line skipped")
            continue
        if not isinstance(record, dict):
            if warnings is not None:
                warnings.append(
                    f"{source}:{lineno}: not a record with a numeric 'step'; line skipped"
                )
            continue
        records.append((lineno, record))
    return records


def read_metrics_text(path: str | Path) -> str:
    """The text of a metrics file; a corrupt byte spoils one line (skipped as not JSON), not
    the whole file."""
    return Path(path).read_text(encoding="utf-8", errors="replace")


def read_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``output_dir/metrics.jsonl`` (``[]`` when there is none), bad lines skipped."""
    path = metrics_path(output_dir)
    if not path.is_file():
        return []
    return [record for _, record in parse_records(read_metrics_text(path), path)]


__all__ = ["METRICS_FILE", "metrics_path", "parse_records", "read_metrics_text", "read_records"]
