"""Open a page in headless Chromium, hover a line, read back what happened; take screenshots.

Chromium (Debian's ``chromium`` package; the README's first command installs it when missing,
with scripts/install-chromium.sh) runs without any Python driver: ``--dump-dom`` prints the DOM
after the page loaded, and a probe script appended to the page (after the page's own script) reports into that DOM what the test asks:
the panels, a hover over a line (a real ``mousemove`` at the screen position of one of the
line's points, through the page's own listener), and every error and console warning (caught by
a second probe at the top of ``<head>``, before any page code runs). Console messages also go to
Chromium's log on stderr (``--enable-logging=stderr``), the second, independent channel.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: Chromium's log line for a console message (``console.*`` and uncaught exceptions).
CONSOLE_LINE = re.compile(r":CONSOLE[:(]")

_HEAD_PROBE = """<script>window.__probeErrors=[];
window.addEventListener('error',e=>__probeErrors.push('error: '+e.message));
window.addEventListener('unhandledrejection',e=>__probeErrors.push('rejection: '+e.reason));
for(const level of ['error','warn']){const f=console[level];
 console[level]=(...a)=>{__probeErrors.push(level+': '+a.join(' '));f.apply(console,a);};}
</script>"""
_TAIL_PROBE = """<script>(function(){
const out={errors:window.__probeErrors,panels:[],hover:null};
document.querySelectorAll('figure.panel').forEach(f=>out.panels.push(f.dataset.metric));
const fig=[...document.querySelectorAll('figure.panel')].find(f=>f.dataset.metric===%(metric)s);
if(fig){
 const svg=fig.querySelector('svg'),line=fig.querySelector('g.run polyline.raw');
 const pts=line.getAttribute('points').trim().split(/\\s+/),i=Math.floor(pts.length/2);
 const [x,y]=pts[i].split(',').map(Number);
 const p=svg.createSVGPoint();p.x=x;p.y=y;const c=p.matrixTransform(svg.getScreenCTM());
 svg.dispatchEvent(new MouseEvent('mousemove',{clientX:c.x,clientY:c.y,bubbles:true}));
 const tip=fig.querySelector('.tip');
 out.hover={point:i,text:tip.textContent,display:getComputedStyle(tip).display,
  cursor:Number(svg.querySelector('.cursor').getAttribute('x1')),x:x};
}
const pre=document.createElement('pre');pre.id='probe';pre.style.display='none';
pre.textContent=JSON.stringify(out);document.body.appendChild(pre);})();</script>"""


def chromium() -> str:
    """The Chromium binary; a missing one FAILS the test (the README's first command installs it:
    scripts/install-chromium.sh)."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError(
        "headless Chromium is needed for this test and was not found: install Debian's "
        "`chromium` package (sh scripts/install-chromium.sh, which the README's first command runs)"
    )


def with_probe(page: str, hover_metric: str) -> str:
    """``page`` with the two probes: error capture first in ``<head>``, the report last."""
    head = page.index("<head>") + len("<head>")
    tail = page.rindex("</body>")
    probe = _TAIL_PROBE % {"metric": json.dumps(hover_metric)}
    return page[:head] + _HEAD_PROBE + page[head:tail] + probe + page[tail:]


def _chromium(args: list[str], profile: Path, size: tuple[int, int]) -> subprocess.CompletedProcess:
    argv = [
        chromium(),
        "--headless",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={size[0]},{size[1]}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def load(page: Path, profile: Path, size: tuple[int, int] = (1400, 900)) -> tuple[dict, list[str]]:
    """Open ``page`` (probed by :func:`with_probe`): the probe's report, and Chromium's console
    log lines."""
    done = _chromium(["--dump-dom", page.resolve().as_uri()], profile, size)
    found = re.search(r'<pre id="probe"[^>]*>(.*?)</pre>', done.stdout, re.S)
    if found is None:
        raise AssertionError(f"the probe did not report; page output:\n{done.stdout[-2000:]}")
    text = found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    report = json.loads(text.replace("&amp;", "&"))
    console = [line for line in done.stderr.splitlines() if CONSOLE_LINE.search(line)]
    return report, console


def screenshot(page: Path, png: Path, profile: Path, size: tuple[int, int]) -> None:
    """A PNG of ``page`` as it is after loading (a probed page shows its hover)."""
    png.parent.mkdir(parents=True, exist_ok=True)
    _chromium([f"--screenshot={png.resolve()}", page.resolve().as_uri()], profile, size)
    if not png.is_file():
        raise AssertionError(f"chromium wrote no screenshot to {png}")


__all__ = ["chromium", "load", "screenshot", "with_probe"]
