"""``grimoire plot --out x.html`` opened in headless Chromium (issue #28, item 6).

A real run (``grimoire train``, shortened) and a real ``grimoire plot`` in an empty folder, then
the page in Chromium (tests/helpers/browser.py): it loads without a console error or warning,
it has one panel per numeric metric of metrics.jsonl (read independently of the plot code), and
moving the pointer onto a point of the loss line shows that point's step and logged value. A
missing Chromium fails these tests (the README's first command installs it: scripts/install-chromium.sh); it never skips them.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys

import pytest
from tests.helpers.browser import load, with_probe
from tests.helpers.commands import ROOT, grimoire_command, run
from tests.test_plot import numeric_keys, one_panel_per_curve

RUN = "output/quickstart"
TIP = re.compile(r"^quickstart: step (\S+)  (\S+)  \(smoothed (\S+)\)$")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An empty folder where the embedded quickstart ran briefly (train and eval records)."""
    root = tmp_path_factory.mktemp("newcomer")
    shorter = ["training.max_steps=12", "training.logging_steps=2", "training.eval_steps=6"]
    run([*grimoire_command(), "train", *[a for s in shorter for a in ("--set", s)]], root)
    return root


def test_html_plot_loads_has_a_panel_per_metric_and_hover_shows_values(folder, tmp_path):
    run([*grimoire_command(), "plot", RUN, "--out", "plot.html"], folder)
    page = (folder / "plot.html").read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(with_probe(page, "loss"), encoding="utf-8")
    report, console = load(probed, tmp_path / "profile")

    assert report["errors"] == [] and console == []
    metrics = folder / RUN / "metrics.jsonl"
    assert set(report["panels"]) <= numeric_keys(metrics)
    assert one_panel_per_curve(report["panels"], metrics)  # identical curves share a panel

    train = [json.loads(x) for x in metrics.read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in train if r["split"] == "train"]
    hover = report["hover"]
    assert hover["display"] == "block", hover
    tip = TIP.match(hover["text"])
    assert tip is not None, hover["text"]
    step, value = losses[hover["point"]]  # the point the pointer was moved onto
    assert float(tip.group(1)) == step
    assert math.isclose(float(tip.group(2)), value, rel_tol=1e-5)
    assert math.isfinite(float(tip.group(3)))
    assert abs(hover["cursor"] - hover["x"]) < 1.0  # the cursor line follows the pointer


def test_docs_screenshot_is_made_by_its_script(folder, tmp_path):
    doc = (ROOT / "docs" / "after-training.md").read_text(encoding="utf-8")
    assert "![" in doc and "(img/plot_html.png)" in doc
    assert "python docs/img/plot_screenshot.py" in doc
    assert (ROOT / "docs" / "img" / "plot_html.png").is_file()
    png = tmp_path / "shot.png"
    script = ROOT / "docs" / "img" / "plot_screenshot.py"
    run([sys.executable, str(script), "--runs", RUN, "--out", str(png)], folder)
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (1400, 900)


def test_the_probe_sees_errors_and_console_messages(tmp_path):
    """The checks above can fail: a page with an uncaught error and a warning is reported."""
    page = tmp_path / "bad.html"
    bad = "<html><head></head><body><script>console.warn('w');undefinedFn();</script></body></html>"
    page.write_text(with_probe(bad, "loss"), encoding="utf-8")
    report, console = load(page, tmp_path / "profile")
    assert report["errors"][0] == "warn: w" and "undefinedFn" in report["errors"][1]
    assert len(console) == 2 and report["panels"] == [] and report["hover"] is None
