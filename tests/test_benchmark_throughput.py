"""benchmarks/throughput.py in its seconds-long mode: the table has one row per implementation
and precision, with the padded path as the ratio's unit and a missing peer reported as skipped.
Times are not checked (they depend on the machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_table_shape(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "throughput.py"),
        "--tiny",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--precisions",
        "no",
        "--impls",
        "ours packed",
        "ours packed+ckpt",
        "ours padded",
        "grimoire-rl",
        "--repeats",
        "2",
        "--peer-python",
        str(tmp_path / "no-such-venv" / "python"),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["precision"], r["impl"]) for r in rows] == [
        ("fp32", "ours packed"),
        ("fp32", "ours packed+ckpt"),
        ("fp32", "ours padded"),
        ("fp32", "grimoire-rl"),
    ]
    packed, ckpt, padded, peer = rows
    for row in (packed, ckpt, padded):
        assert row["tok_s"] > 0 and row["mfu"] > 0
        # Two interleaved runs; the upper median of two is the larger.
        assert len(row["tok_s_runs"]) == 2 and row["tok_s"] == max(row["tok_s_runs"])
        assert row["note"].startswith("median of 2: ")
    assert padded["ratio"] == 1.0
    assert abs(packed["ratio"] - packed["tok_s"] / padded["tok_s"]) < 1e-9
    assert peer["tok_s"] is None and "no peer venv" in peer["note"]
    printed = proc.stdout
    assert printed.startswith("# machine: ")
    assert "GEMM peak measured here" in printed
    table = [ln.split()[:2] for ln in printed.splitlines() if ln.startswith(("ours", "grimoire"))]
    assert [t[0] for t in table] == ["ours", "ours", "ours", "grimoire-rl"]
    assert table[3][1] == "-"  # the skipped peer prints no rate


def test_model_flops_by_hand():
    """6 x params per token plus 6 x layers x hidden x len^2 of causal attention."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import throughput
    finally:
        sys.path.pop(0)
    rows = [{"input_ids": [0] * 3}, {"input_ids": [0] * 5}]
    expected = 6 * 10 * 8 + 6 * 2 * 4 * (9 + 25)
    assert throughput.model_flops(rows, params=10, layers=2, hidden=4) == expected


def test_long_tailed_rows_mask_the_prompt_quarter():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import throughput
    finally:
        sys.path.pop(0)
    rows = throughput.long_tailed_rows(200, vocab=100, max_len=64, seed=1)
    lengths = [len(r["input_ids"]) for r in rows]
    assert max(lengths) <= 64 and min(lengths) >= 16
    assert rows == throughput.long_tailed_rows(200, vocab=100, max_len=64, seed=1)
    for r in rows:
        prompt = max(1, len(r["input_ids"]) // 4)
        assert r["labels"][:prompt] == [-100] * prompt
        assert r["labels"][prompt:] == r["input_ids"][prompt:]
        assert r["completion_mask"] == [0] * prompt + [1] * (len(r["input_ids"]) - prompt)
