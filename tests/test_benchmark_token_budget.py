"""Smoke test of benchmarks/token_budget_memory.py: ``--quick`` runs and its table holds up.

Each cell is a fresh interpreter (about 5 s of imports alone), so the test runs one family,
GRPO (generation, reference and training passes all under the budget), two cells at a time.
No wall-clock assertions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "token_budget_memory.py"


def parse_table(text: str) -> list[dict[str, str]]:
    """The markdown table's rows as ``{header: cell}``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").replace("-", "")) <= {""}, lines[1]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(header), ln
        rows.append(dict(zip(header, cells)))
    return rows


def test_quick_table_parses_and_passes_stay_within_budget():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    # One thread per cell: the suite runs beside another worker (tests/conftest.py); memory,
    # not speed, is what the table is read for.
    cmd = [sys.executable, str(SCRIPT), "--quick", "--families", "grpo", "--jobs", "2"]
    cmd += ["--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("# command: python ")
    assert "cpu capability" in text and "torch " in text

    rows = parse_table(text)
    paths = [(r["family"], r["path"]) for r in rows]
    assert paths == [("grpo", p) for p in ("padded", "budget 256", "budget 512")]
    for r in rows:
        largest = int(r["largest pass (tokens)"])
        memory = float(r["peak memory above baseline (MiB)"])
        ratio = float(r["ratio vs padded"].rstrip("x"))
        assert largest > 0 and memory >= 0 and ratio >= 0
        if r["path"] == "padded":
            assert ratio == 1.0
            # padded: batch_size rows (x 4 generations for GRPO) padded to the longest
            assert largest > 512
        else:
            budget = int(r["path"].removeprefix("budget "))
            assert largest <= budget, r
