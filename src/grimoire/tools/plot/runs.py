"""``grimoire plot``'s data: each run's curves from its ``metrics.jsonl``, panel order, smoothing.

Input rules: a missing or empty ``metrics.jsonl`` is an error. A value that is not a number for
a key that is numeric elsewhere (a metric) is skipped with a warning naming file, line and key:
one bad point should not stop anyone from looking at a run in progress. The lines themselves
are parsed by :func:`grimoire.training.records.parse_records`, the reader the run summary uses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grimoire.errors import DataError, GrimoireError
from grimoire.training.records import metrics_path, parse_records, read_metrics_text

#: Record fields that are coordinates, not metrics: ``step`` is the x axis.
AXIS_KEYS = frozenset({"split", "step", "epoch"})
#: Panels shown first when present; every other metric follows in the order first seen.
FIRST = ("loss", "lr", "grad_norm", "tokens_per_sec")
DEFAULT_SMOOTH = "0.6"
#: One colour per run, in order (PNG and HTML alike).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass
class RunCurves:
    """One run: metric name -> (steps, values), sorted by step, one value per step."""

    label: str
    path: Path
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_run(run_dir: str | Path, warnings: list[str]) -> RunCurves:
    """Read ``run_dir/metrics.jsonl``; raise :class:`DataError` when there is nothing to plot."""
    path = metrics_path(run_dir)
    if not path.is_file():
        where = f"{run_dir}: no such directory" if not Path(run_dir).is_dir() else f"{path}: none"
        raise DataError(
            [f"{where}; metrics.jsonl is written by `grimoire train` into its output_dir"]
        )
    text = read_metrics_text(path)
    if not text.strip():
        raise DataError([f"{path} is empty: the run has not logged a step yet"])
    points: dict[str, dict[float, float]] = {}
    rejected: list[tuple[int, str, Any]] = []
    records = 0
    for lineno, rec in parse_records(text, path, warnings):
        if not _is_number(rec.get("step")):
            warnings.append(f"{path}:{lineno}: not a record with a numeric 'step'; line skipped")
            continue
        records += 1
        eval_split = rec.get("split") == "eval"
        for key, value in rec.items():
            if key in AXIS_KEYS:
                continue
            if eval_split and not key.startswith("eval/"):
                key = f"eval/{key}"
            if _is_number(value):
                # A resumed run can log a step twice; the later line is the one that counts.
                points.setdefault(key, {})[float(rec["step"])] = float(value)
            else:
                rejected.append((lineno, key, value))
    if not records:
        raise DataError([f"{path} has no complete records yet"])
    for lineno, key, value in rejected:
        if key in points:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            warnings.append(f"{path}:{lineno}: {key!r} is {shown}, not a number; point skipped")
    for key in dict.fromkeys(k for _, k, _ in rejected if k not in points):
        warnings.append(f"{path}: {key!r} has no numeric value on any line; not plotted")
    if not points:
        raise DataError([f"{path} has no numeric metrics to plot"])
    run = RunCurves(label=Path(run_dir).resolve().name, path=path)
    for key, by_step in points.items():
        steps = sorted(by_step)
        run.series[key] = (steps, [by_step[s] for s in steps])
    return run


def read_runs(run_dirs: Sequence[str | Path], warnings: list[str]) -> list[RunCurves]:
    """Every run, or one :class:`DataError` listing every unreadable run."""
    runs, problems = [], []
    for d in run_dirs:
        try:
            runs.append(read_run(d, warnings))
        except DataError as exc:
            problems += exc.problems
    if problems:
        raise DataError(problems, title="nothing to plot")
    # Same folder names (a/out, b/out) get their parent prepended so the legend tells them apart.
    names = [r.label for r in runs]
    for r in runs:
        if names.count(r.label) > 1:
            r.label = f"{r.path.parent.parent.name}/{r.label}"
    return runs


def panel_keys(runs: Sequence[RunCurves]) -> list[str]:
    """All metrics of all runs: :data:`FIRST`, other train metrics, then eval metrics."""
    seen = list(dict.fromkeys(k for r in runs for k in r.series))
    first = [k for k in FIRST if k in seen]
    train = [k for k in seen if k not in first and not k.startswith("eval/")]
    return first + train + [k for k in seen if k.startswith("eval/")]


def panel_groups(runs: Sequence[RunCurves]) -> list[list[str]]:
    """:func:`panel_keys` with the metrics whose curves are identical in every run (the same
    steps and values: ``reward`` / ``rewards/mean`` / ``rewards/<fn>/mean`` with one reward
    function, SFT's ``loss`` / ``nll``) in one panel, named by the first key of each group."""
    groups: dict[tuple, list[str]] = {}
    for key in panel_keys(runs):
        curves = tuple(
            (tuple(r.series[key][0]), tuple(r.series[key][1])) if key in r.series else None
            for r in runs
        )
        groups.setdefault(curves, []).append(key)
    return list(groups.values())


def panel_title(group: Sequence[str]) -> str:
    """``reward (= rewards/mean, rewards/length/mean)``: the panel's key and its duplicates."""
    return group[0] + (f" (= {', '.join(group[1:])})" if len(group) > 1 else "")


def parse_smooth(text: str) -> float | int:
    """``--smooth``: an integer N >= 1 is a trailing moving average over N points; a number in
    [0, 1) is an exponential moving average weight (TensorBoard-style; 0 = no smoothing)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if text.strip().isdigit() and value >= 1:
        return int(value)
    if 0 <= value < 1:
        return value
    raise GrimoireError(
        f"--smooth {text!r}: give an integer window N >= 1, or an EMA weight in [0, 1)"
    )


def smooth(values: Sequence[float], spec: float | int, key: str = "") -> list[float]:
    """Smoothed ``values``; NaN (a gap) stays NaN and does not disturb its neighbours.

    Evaluation metrics (``eval/...``) are left raw: each point already averages a whole eval
    set, and with a handful of points smoothing would only make the curve lag.
    """
    if key.startswith("eval/"):
        return list(values)
    out: list[float] = []
    if isinstance(spec, int):
        window: list[float] = []  # the last N finite values
        for v in values:
            if math.isfinite(v):
                window = (window + [v])[-spec:]
            out.append(sum(window) / len(window) if math.isfinite(v) else math.nan)
        return out
    # Debiased EMA: without the 1 - w^n correction the first points would be pulled to 0.
    last, n = 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        last, n = spec * last + (1 - spec) * v, n + 1
        out.append(last / (1 - spec**n))
    return out


__all__ = [
    "AXIS_KEYS",
    "COLORS",
    "DEFAULT_SMOOTH",
    "FIRST",
    "RunCurves",
    "panel_groups",
    "panel_keys",
    "panel_title",
    "parse_smooth",
    "read_run",
    "read_runs",
    "smooth",
]
