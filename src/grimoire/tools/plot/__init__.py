"""``grimoire plot``: training curves from one or more runs' ``metrics.jsonl``.

Usage::

    grimoire plot RUN_DIR [RUN_DIR ...] [--out FILE.png|FILE.html] [--smooth 0.6|N]

One panel per numeric metric found in the files (train metrics, then ``eval/...``), each run a
smoothed line over its faint raw line. PNG needs matplotlib (``pip install matplotlib``); HTML
is one self-contained file (inline SVG + a small script: hover values, toggle runs), so it
needs nothing. It can be run while training: it reads the lines written so far and skips a
last line that is still being written.

Modules: :mod:`~grimoire.tools.plot.runs` (reading runs, panel order, smoothing),
:mod:`~grimoire.tools.plot.figure` (PNG), :mod:`~grimoire.tools.plot.page` (HTML) and
:mod:`~grimoire.tools.plot.cli` (``main``, the ``grimoire plot`` command).
"""

from grimoire.tools.plot.cli import main, plot
from grimoire.tools.plot.figure import build_figure
from grimoire.tools.plot.page import render_html
from grimoire.tools.plot.runs import (
    AXIS_KEYS,
    COLORS,
    DEFAULT_SMOOTH,
    FIRST,
    RunCurves,
    panel_groups,
    panel_keys,
    parse_smooth,
    read_run,
    read_runs,
    smooth,
)

__all__ = [
    "AXIS_KEYS",
    "COLORS",
    "DEFAULT_SMOOTH",
    "FIRST",
    "RunCurves",
    "build_figure",
    "main",
    "panel_groups",
    "panel_keys",
    "parse_smooth",
    "plot",
    "read_run",
    "read_runs",
    "render_html",
    "smooth",
]
