"""``grimoire plot``: training curves from one or more runs' ``metrics.jsonl``.

Usage::

    grimoire plot RUN_DIR [RUN_DIR ...] [--out FILE.png|FILE.html] [--smooth 0.6|N]

One panel per numeric metric found in the files (train metrics, then ``eval/...``), each run a
smoothed line over its faint raw line. PNG needs matplotlib (``pip install matplotlib``); HTML
is one self-contained file (inline SVG + a small script: hover values, toggle runs), so it
needs nothing. It can be run while training: it reads the lines written so far and skips a
last line that is still being written.

Input rules: a missing or empty ``metrics.jsonl`` is an error. A value that is not a number for
a key that is numeric elsewhere (a metric) is skipped with a warning naming file, line and key:
one bad point should not stop anyone from looking at a run in progress.
"""

from __future__ import annotations

import html
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grimoire.errors import DataError, GrimoireError
from grimoire.tools.common import ToolParser, run_tool

#: Record fields that are coordinates, not metrics: ``step`` is the x axis.
AXIS_KEYS = frozenset({"split", "step", "epoch"})
#: Panels shown first when present; every other metric follows in the order first seen.
FIRST = ("loss", "lr", "grad_norm", "tokens_per_sec")
DEFAULT_SMOOTH = "0.6"
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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        where = f"{run_dir}: no such directory" if not Path(run_dir).is_dir() else f"{path}: none"
        raise DataError(
            [f"{where}; metrics.jsonl is written by `grimoire train` into its output_dir"]
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataError([f"{path} is empty: the run has not logged a step yet"])
    lines = text.split("\n")
    points: dict[str, dict[float, float]] = {}
    rejected: list[tuple[int, str, Any]] = []
    records = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # no newline yet: the trainer is writing this line
                continue
            warnings.append(f"{path}:{lineno}: not valid JSON; line skipped")
            continue
        if not isinstance(rec, dict) or not _is_number(rec.get("step")):
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


# --------------------------------------------------------------------------- PNG


def build_figure(runs: Sequence[RunCurves], spec: float | int) -> Any:
    """A matplotlib ``Figure`` (no pyplot, so no global backend state is touched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise GrimoireError(
            "PNG output needs matplotlib: pip install matplotlib (or write --out FILE.html, "
            "which needs nothing)"
        ) from exc
    keys = panel_keys(runs)
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
        ax.set_title(key, fontsize=10)
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


# --------------------------------------------------------------------------- HTML

W, H, LEFT, RIGHT, TOP, BOTTOM = 440, 240, 58, 12, 10, 26


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round-number ticks covering [lo, hi]."""
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _panel_svg(key: str, runs: Sequence[RunCurves], spec: float | int) -> tuple[str, dict]:
    curves = [(i, *run.series[key]) for i, run in enumerate(runs) if key in run.series]
    xs = [x for _, s, _ in curves for x in s]
    ys = [y for _, _, v in curves for y in v if math.isfinite(y)] or [0.0]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM)

    def lines(steps: list[float], values: list[float], cls: str) -> str:
        segments, seg = [], []
        for x, y in zip(steps, values):
            if math.isfinite(y):
                seg.append(f"{px(x):.1f},{py(y):.1f}")
            elif seg:
                segments, seg = [*segments, seg], []
        segments += [seg] if seg else []
        return "".join(f'<polyline class="{cls}" points="{" ".join(s)}"/>' for s in segments)

    parts = [f'<svg viewBox="0 0 {W} {H}" class="chart">']
    for t in _ticks(y0, y1):
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" '
            f'y2="{py(t):.1f}"/><text class="tick" x="{LEFT - 4}" y="{py(t) + 3:.1f}" '
            f'text-anchor="end">{t:.4g}</text>'
        )
    for t in _ticks(x0, x1):
        parts.append(
            f'<text class="tick" x="{px(t):.1f}" y="{H - BOTTOM + 14}" '
            f'text-anchor="middle">{t:.6g}</text>'
        )
    data: dict[str, Any] = {"x0": x0, "x1": x1, "runs": {}}
    for i, steps, values in curves:
        smoothed = smooth(values, spec, key)
        label = html.escape(runs[i].label)
        dots = (
            "".join(  # hover without the script: a <title> per point on short series
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"><title>{label} step {x:g}: '
                f"{y:.6g}</title></circle>"
                for x, y in zip(steps, values)
                if math.isfinite(y)
            )
            if len(steps) <= 60
            else ""
        )
        parts.append(
            f'<g class="run" data-run="{i}" style="--c:{COLORS[i % len(COLORS)]}">'
            f"{lines(steps, values, 'raw')}{lines(steps, smoothed, 'smooth')}{dots}</g>"
        )
        data["runs"][i] = [
            [float(f"{v:.6g}") if math.isfinite(v) else None for v in col]
            for col in (steps, values, smoothed)
        ]
    parts.append(f'<line class="cursor" y1="{TOP}" y2="{H - BOTTOM}" x1="-9" x2="-9"/></svg>')
    return "".join(parts), data


_STYLE = """body{font:13px system-ui,sans-serif;margin:16px;color:#222}
#legend label{margin-right:14px;cursor:pointer}#legend i{display:inline-block;width:18px;
height:3px;vertical-align:middle;margin:0 4px}.panels{display:grid;gap:10px;
grid-template-columns:repeat(auto-fill,minmax(440px,1fr))}figure{margin:0;position:relative;
border:1px solid #ddd;border-radius:4px;padding:4px}figcaption{font-weight:600;padding:2px 6px}
.chart{width:100%;height:auto}.grid{stroke:#eee}.tick{font-size:9px;fill:#777}
.run polyline{fill:none;stroke:var(--c)}.raw{opacity:.25}.smooth{stroke-width:1.8}
.run circle{fill:var(--c)}.run.off{display:none}.cursor{stroke:#999;stroke-dasharray:3}
.tip{position:absolute;pointer-events:none;background:#fff;border:1px solid #bbb;
padding:3px 6px;font-size:11px;white-space:pre;display:none;top:28px}"""

_SCRIPT = """const D=JSON.parse(document.getElementById('grimoire-data').textContent);
const off=new Set();
document.querySelectorAll('#legend input').forEach(cb=>cb.addEventListener('change',()=>{
 const r=cb.dataset.run;cb.checked?off.delete(r):off.add(r);
 document.querySelectorAll('g.run[data-run="'+r+'"]').forEach(g=>g.classList.toggle('off',!cb.checked));}));
function near(xs,x){let b=0;xs.forEach((v,i)=>{if(Math.abs(v-x)<Math.abs(xs[b]-x))b=i});return b}
document.querySelectorAll('figure.panel').forEach(fig=>{
 const svg=fig.querySelector('svg'),cur=svg.querySelector('.cursor'),tip=fig.querySelector('.tip');
 const p=D.panels[fig.dataset.metric],L=%(left)s,R=%(w)s-%(right)s;
 svg.addEventListener('mousemove',e=>{
  const pt=svg.createSVGPoint();pt.x=e.clientX;pt.y=e.clientY;
  const u=pt.matrixTransform(svg.getScreenCTM().inverse());
  const x=p.x0+(u.x-L)/(R-L)*(p.x1-p.x0);let rows=[];
  for(const [r,c] of Object.entries(p.runs)){if(off.has(r))continue;const i=near(c[0],x);
   rows.push(D.labels[r]+': step '+c[0][i]+'  '+c[1][i]+'  (smoothed '+(c[2][i]===null?'-':c[2][i].toPrecision(5))+')');}
  cur.setAttribute('x1',u.x);cur.setAttribute('x2',u.x);
  tip.textContent=rows.join('\\n');tip.style.display=rows.length?'block':'none';
  const fx=e.clientX-fig.getBoundingClientRect().left;
  tip.style.left=Math.max(4,Math.min(fx+12,fig.clientWidth-tip.offsetWidth-4))+'px';});
 svg.addEventListener('mouseleave',()=>{tip.style.display='none';cur.setAttribute('x1',-9);cur.setAttribute('x2',-9);});});"""


def render_html(runs: Sequence[RunCurves], spec: float | int) -> str:
    """One self-contained HTML page: no external file, font, script or network access."""
    legend = "".join(
        f'<label class="legend-entry" data-run="{i}"><input type="checkbox" checked '
        f'data-run="{i}"><i style="background:{COLORS[i % len(COLORS)]}"></i>'
        f"{html.escape(r.label)}</label>"
        for i, r in enumerate(runs)
    )
    panels, data = [], {"labels": {i: r.label for i, r in enumerate(runs)}, "panels": {}}
    for key in panel_keys(runs):
        svg, data["panels"][key] = _panel_svg(key, runs, spec)
        panels.append(
            f'<figure class="panel" data-metric="{html.escape(key)}"><figcaption>'
            f'{html.escape(key)}</figcaption>{svg}<div class="tip"></div></figure>'
        )
    # "</" inside the JSON would end the <script> element early (a run named "</script>").
    blob = json.dumps(data).replace("</", "<\\/")
    script = _SCRIPT % {"left": LEFT, "w": W, "right": RIGHT}
    title = html.escape(", ".join(r.label for r in runs))
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>grimoire: {title}</title>'
        f'<style>{_STYLE}</style></head><body><div id="legend">{legend}</div>'
        f'<p style="color:#777">smoothing {spec} (eval/ metrics raw); hover a panel for values, click a run to '
        f'hide it</p><div class="panels">{"".join(panels)}</div>'
        f'<script type="application/json" id="grimoire-data">{blob}</script>'
        f"<script>{script}</script></body></html>"
    )


# --------------------------------------------------------------------------- CLI


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
        for w in warnings[:20]:
            print(f"grimoire plot: warning: {w}", file=sys.stderr)
        if len(warnings) > 20:
            print(f"grimoire plot: warning: ... and {len(warnings) - 20} more", file=sys.stderr)
        print(f"wrote {out}")
        return 0

    return run_tool("plot", body)
