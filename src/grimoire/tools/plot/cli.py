"""``grimoire plot`` on the command line: arguments, output format by suffix, warnings."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from grimoire.columns import listed
from grimoire.errors import GrimoireError
from grimoire.tools.common import ToolParser, run_tool
from grimoire.tools.plot.figure import build_figure
from grimoire.tools.plot.page import render_html
from grimoire.tools.plot.runs import DEFAULT_SMOOTH, parse_smooth, read_runs


def plot(run_dirs: Sequence[str | Path], out: str | Path, spec: float | int = 0.6) -> list[str]:
    """Write ``out`` (.png or .html) for ``run_dirs``; return the warnings about skipped data."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise GrimoireError(f"--out {out}: the file must end in .png or .html")
    warnings: list[str] = []
    runs = read_runs(run_dirs, warnings)
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".png":
        build_figure(runs, spec).savefig(out, dpi=110)
    else:
        out.write_text(render_html(runs, spec), encoding="utf-8")
    return warnings


def main(argv: Sequence[str]) -> int:
    """``grimoire plot``: returns the exit code."""
    p = ToolParser(prog="grimoire plot", description="Plot the metrics.jsonl of training runs.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir")
    p.add_argument("--out", help="FILE.png or FILE.html (default for one run: RUN_DIR/plots.png)")
    p.add_argument(
        "--smooth",
        default=DEFAULT_SMOOTH,
        help="integer N: moving average over N points; 0 <= a < 1: EMA weight "
        f"(default {DEFAULT_SMOOTH}; 0 or 1 = raw)",
    )

    def body() -> int:
        args = p.parse_args(list(argv))
        spec = parse_smooth(args.smooth)
        if args.out is None and len(args.run_dirs) > 1:
            raise GrimoireError("several runs: say where to write them with --out FILE.png|.html")
        out = args.out or str(Path(args.run_dirs[0]) / "plots.png")
        warnings = plot(args.run_dirs, out, spec)
        for w in listed(warnings):
            print(f"grimoire plot: warning: {w}", file=sys.stderr)
        print(f"wrote {out}")
        return 0

    return run_tool("plot", body)


__all__ = ["main", "plot"]
