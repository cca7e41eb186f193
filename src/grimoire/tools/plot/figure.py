"""``grimoire plot --out FILE.png``: the curves as a matplotlib figure (one panel per metric).

matplotlib is optional (``pip install matplotlib``); without it the PNG path says so and points
to the HTML output, which needs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from grimoire.errors import GrimoireError
from grimoire.tools.plot.runs import COLORS, RunCurves, panel_groups, panel_title, smooth


def build_figure(runs: Sequence[RunCurves], spec: float | int) -> Any:
    """A matplotlib ``Figure`` (no pyplot, so no global backend state is touched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise GrimoireError(
            "PNG output needs matplotlib: pip install matplotlib (or write --out FILE.html, "
            "which needs nothing)"
        ) from exc
    groups = panel_groups(runs)
    keys = [g[0] for g in groups]
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.1 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        for i, run in enumerate(runs):
            if key not in run.series:
                continue
            steps, values = run.series[key]
            color = COLORS[i % len(COLORS)]
            marker = "o" if len(steps) <= 12 else None  # a few eval points: show each one
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(
                steps,
                smooth(values, spec, key),
                color=color,
                linewidth=1.6,
                marker=marker,
                markersize=3,
                label=run.label,
            )
        ax.set_title(panel_title(groups[keys.index(key)]), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    handles = [
        next(line for ax in axes for line in ax.get_lines() if line.get_label() == run.label)
        for run in runs
    ]
    fig.legend(
        handles,
        [r.label for r in runs],
        loc="outside upper center",
        ncols=min(len(runs), 6),
        frameon=False,
    )
    return fig


__all__ = ["build_figure"]
