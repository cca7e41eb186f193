"""Make docs/img/plot_html.png: ``grimoire plot --out FILE.html`` in headless Chromium, with the
pointer over the loss panel.

    python docs/img/plot_screenshot.py                  # two short quickstart runs, then the shot
    python docs/img/plot_screenshot.py --runs output/quickstart --out /tmp/shot.png

Needs Chromium (Debian: ``apt-get install -y chromium``). The page is opened with the probe of
``tests/helpers/browser.py`` (the same one ``tests/test_plot_browser.py`` checks the page with),
which moves the pointer onto the middle point of the first run's loss line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers: the harness shared with the test

from tests.helpers.browser import screenshot, with_probe  # noqa: E402
from tests.helpers.commands import grimoire_command, run  # noqa: E402

SIZE = (1400, 900)
#: The default runs: the quickstart for 300 steps at two learning rates (folder name = label).
RUNS = {"lr-1.5e-3": [], "lr-5e-4": ["--set", "training.learning_rate=5e-4"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", help="run folders to plot (default: train two)")
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "plot_html.png"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plot_screenshot_"))
    runs = [str(Path(r).resolve()) for r in args.runs or []]
    for name, extra in ({} if runs else RUNS).items():
        out = work / name
        sets = [f"training.output_dir={out}", "save_to=false", "training.max_steps=300"]
        run([*grimoire_command(), "train", *[a for s in sets for a in ("--set", s)], *extra], work)
        runs.append(str(out))
    page = work / "plot.html"
    run([*grimoire_command(), "plot", *runs, "--out", str(page)], work)
    probed = work / "probed.html"
    probed.write_text(with_probe(page.read_text(encoding="utf-8"), "loss"), encoding="utf-8")
    screenshot(probed, Path(args.out), work / "profile", SIZE)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
