"""``grimoire plot``: PNG and HTML from metrics.jsonl, panels from the data, bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from grimoire.cli.main import main as cli
from grimoire.tools.plot import build_figure, read_runs, smooth

PNG_DPI = 110  # plot.py saves at this dpi; the figure is 5.2 x (3.1 rows + 0.6) inches per column


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, tiny_dir, tokenizer):
    """A real trainer run (SimPO: method metrics, plus evaluations) writing metrics.jsonl."""
    from tests.helpers.train_utils import quiet_config, train
    from transformers import AutoModelForCausalLM

    from grimoire.data import tokenize_preference
    from grimoire.losses import SimPOLoss
    from grimoire.model.tiny import preference_rows

    out = tmp_path_factory.mktemp("runs") / "simpo"
    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(8, seed=1)]
    config = quiet_config(out, max_steps=4, eval_steps=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    train(model, tokenizer, rows, SimPOLoss(), config, eval_dataset=rows[:4])
    return out


def numeric_keys(path: Path) -> set[str]:
    """The metric keys of a metrics.jsonl, read independently of plot.py."""
    keys = set()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k in ("step", "epoch", "split") or isinstance(v, bool):
                continue
            if isinstance(v, int | float):
                keys.add(k if rec["split"] == "train" or k.startswith("eval/") else f"eval/{k}")
    return keys


def distinct_curves(path: Path) -> list[set[str]]:
    """The metric keys of a metrics.jsonl grouped by identical curves (same steps and values),
    read independently of plot.py: each group is one panel."""
    curves: dict[str, dict[float, float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k in ("step", "epoch", "split") or isinstance(v, bool):
                continue
            if isinstance(v, int | float):
                key = k if rec["split"] == "train" or k.startswith("eval/") else f"eval/{k}"
                curves.setdefault(key, {})[rec["step"]] = float(v)
    groups: dict[tuple, set[str]] = {}
    for key, points in curves.items():
        groups.setdefault(tuple(sorted(points.items())), set()).add(key)
    return list(groups.values())


def one_panel_per_curve(panels: list[str], path: Path) -> bool:
    """Each group of identical curves has exactly one panel, named by one of its keys."""
    groups = distinct_curves(path)
    return len(panels) == len(groups) and all(sum(p in g for p in panels) == 1 for g in groups)


def html_data(path: Path) -> dict:
    text = path.read_text()
    blob = re.search(r'<script type="application/json" id="grimoire-data">(.*?)</script>', text)
    return json.loads(blob.group(1).replace("<\\/", "</"))


def write_jsonl(folder: Path, lines: list[str], newline_at_end: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + ("\n" if newline_at_end else "")
    (folder / "metrics.jsonl").write_text(text)
    return folder


def rec(step: int, **values) -> str:
    return json.dumps({"split": "train", "step": step, "epoch": 0.1 * step, **values})


def test_html_has_a_panel_for_every_numeric_key(real_run, tmp_path):
    keys = numeric_keys(real_run / "metrics.jsonl")
    # The run really logged method metrics and evaluations (else this test would prove little).
    assert {"loss", "lr", "grad_norm", "tokens_per_sec", "eval/loss"} <= keys
    assert any(k.startswith("rewards/") for k in keys)
    out = tmp_path / "p.html"
    assert cli(["plot", str(real_run), "--out", str(out)]) == 0
    text = out.read_text()
    panels = re.findall(r'<figure class="panel" data-metric="([^"]+)"', text)
    assert set(panels) <= keys and one_panel_per_curve(panels, real_run / "metrics.jsonl")
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r'(src|href)="(https?:)?//', text)
    # Plotted values are the logged ones.
    logged = [json.loads(x) for x in (real_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if r["split"] == "train"]
    steps, raw, _ = html_data(out)["panels"]["loss"]["runs"]["0"]
    assert steps == [r["step"] for r in train]
    assert raw == pytest.approx([r["loss"] for r in train], rel=1e-5)


def test_png_is_a_real_png_of_the_expected_size(real_run):
    from PIL import Image

    assert cli(["plot", str(real_run)]) == 0  # default --out: RUN_DIR/plots.png
    out = real_run / "plots.png"
    n = len(distinct_curves(real_run / "metrics.jsonl"))
    rows = math.ceil(n / 3)
    with Image.open(out) as img:
        assert img.format == "PNG"
        assert img.size == (round(3 * 5.2 * PNG_DPI), round((3.1 * rows + 0.6) * PNG_DPI))
        colors = img.convert("RGB").getcolors(maxcolors=1_000_000)
    assert len(colors) > 50  # curves, text and grid were drawn, not a blank canvas


def test_several_runs_overlaid(tmp_path):
    a = write_jsonl(tmp_path / "a" / "run", [rec(1, loss=2.0), rec(2, loss=1.0)])
    b = write_jsonl(tmp_path / "b" / "run", [rec(1, loss=3.0, kl=0.5), rec(2, loss=1.5, kl=0.4)])
    out = tmp_path / "both.html"
    assert cli(["plot", str(a), str(b), "--out", str(out)]) == 0
    text = out.read_text()
    # Same folder names are told apart by their parent.
    labels = re.findall(r'<label class="legend-entry" data-run="\d+">.*?</i>(.*?)</label>', text)
    assert labels == ["a/run", "b/run"]
    data = html_data(out)["panels"]
    assert set(data["loss"]["runs"]) == {"0", "1"}  # both runs in the loss panel
    assert set(data["kl"]["runs"]) == {"1"}  # a metric only one run has
    fig = build_figure(read_runs([a, b], []), 0.6)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a/run", "b/run"]
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    assert len(loss_ax.get_lines()) == 4  # raw + smoothed per run
    png = tmp_path / "both.png"
    assert cli(["plot", str(a), str(b), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partial_last_line_is_skipped_silently(tmp_path, capsys):
    run = write_jsonl(
        tmp_path / "live",
        [rec(1, loss=2.0), rec(2, loss=1.0), '{"split": "train", "step": 3, "lo'],
        newline_at_end=False,
    )
    out = tmp_path / "live.html"
    assert cli(["plot", str(run), "--out", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert html_data(out)["panels"]["loss"]["runs"]["0"][0] == [1, 2]


def test_non_numeric_value_is_skipped_with_a_warning(tmp_path, capsys):
    run = write_jsonl(
        tmp_path / "r",
        [rec(1, loss=2.0, note="x"), rec(2, loss="oops"), rec(3, loss=1.0), "{not json", rec(4)],
    )
    out = tmp_path / "r.html"
    assert cli(["plot", str(run), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    path = run / "metrics.jsonl"
    assert f"{path}:2: 'loss' is \"oops\", not a number; point skipped" in err
    assert f"{path}:4: not valid JSON" in err
    assert "'note' has no numeric value" in err
    data = html_data(out)["panels"]
    assert data["loss"]["runs"]["0"][:2] == [[1, 3], [2.0, 1.0]]
    assert "note" not in data


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (
            lambda d: d.mkdir(),
            "metrics.jsonl: none; metrics.jsonl is written by `grimoire train`",
        ),
        (lambda d: None, "no such directory"),
        (lambda d: write_jsonl(d, []), "is empty: the run has not logged a step yet"),
        (lambda d: write_jsonl(d, ['{"split": "tr'], False), "has no complete records yet"),
        (lambda d: write_jsonl(d, [rec(1, note="x")]), "has no numeric metrics"),
    ],
)
def test_bad_run_dirs(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert cli(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire plot: nothing to plot")
    assert str(run) in err and message in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "x.pdf"], "must end in .png or .html"),
        (["--smooth", "2.5"], "--smooth '2.5': give an integer window"),
        (["--smooth", "-1"], "--smooth '-1'"),
        (["EXTRA_RUN"], "several runs: say where to write them with --out"),
    ],
)
def test_bad_arguments(tmp_path, capsys, args, message):
    run = write_jsonl(tmp_path / "r", [rec(1, loss=1.0)])
    args = [str(tmp_path / a) if a == "EXTRA_RUN" else a for a in args]
    if "--out" in args:
        args[args.index("--out") + 1] = str(tmp_path / args[args.index("--out") + 1])
    assert cli(["plot", str(run), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grimoire plot: ") and message in err


def test_smoothing_by_hand():
    # Debiased EMA, w = 0.5: s1 = 0.5 / 0.5 = 1; s2 = (0.25 + 1.5) / 0.75.
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75])
    assert smooth([1.0, 3.0, 5.0], 2) == pytest.approx([1.0, 2.0, 4.0])
    out = smooth([1.0, math.nan, 3.0], 2)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 2.0
    assert smooth([1.0, 5.0], 0.9, key="eval/loss") == [1.0, 5.0]  # evaluations stay raw
