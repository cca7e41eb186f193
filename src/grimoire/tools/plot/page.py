"""``grimoire plot --out FILE.html``: one self-contained page (inline SVG + a small script).

Hover a panel for values, click a run in the legend to hide it. No external file, font, script
or network access, so the page can be mailed or opened offline.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from grimoire.tools.plot.runs import COLORS, RunCurves, panel_groups, panel_title, smooth

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

    parts = [f'<svg viewBox="0 0 {W} {H}" class="chart">', *_grid(x0, x1, y0, y1, px, py)]
    data: dict[str, Any] = {"x0": x0, "x1": x1, "runs": {}}
    for i, steps, values in curves:
        smoothed = smooth(values, spec, key)
        label = html.escape(runs[i].label)
        dots = _dots(label, steps, values, px, py)
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


def _grid(
    x0: float,
    x1: float,
    y0: float,
    y1: float,
    px: Callable[[float], float],
    py: Callable[[float], float],
) -> list[str]:
    """The horizontal grid lines with their value labels, and the step labels below."""
    parts = [
        f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" '
        f'y2="{py(t):.1f}"/><text class="tick" x="{LEFT - 4}" y="{py(t) + 3:.1f}" '
        f'text-anchor="end">{t:.4g}</text>'
        for t in _ticks(y0, y1)
    ]
    parts += [
        f'<text class="tick" x="{px(t):.1f}" y="{H - BOTTOM + 14}" '
        f'text-anchor="middle">{t:.6g}</text>'
        for t in _ticks(x0, x1)
    ]
    return parts


def _dots(
    label: str,
    steps: list[float],
    values: list[float],
    px: Callable[[float], float],
    py: Callable[[float], float],
) -> str:
    """Hover without the script: a point with a ``<title>`` per finite value of a short series."""
    if len(steps) > 60:
        return ""
    return "".join(
        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"><title>{label} step {x:g}: '
        f"{y:.6g}</title></circle>"
        for x, y in zip(steps, values)
        if math.isfinite(y)
    )


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
    for group in panel_groups(runs):
        key = group[0]
        svg, data["panels"][key] = _panel_svg(key, runs, spec)
        panels.append(
            f'<figure class="panel" data-metric="{html.escape(key)}"><figcaption>'
            f'{html.escape(panel_title(group))}</figcaption>{svg}<div class="tip"></div></figure>'
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


__all__ = ["render_html"]
