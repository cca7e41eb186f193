"""benchmarks/preference_throughput.py and benchmarks/rollout_throughput.py in their seconds-long
``--tiny`` modes: the tables have the expected rows and the rollout engine's promises (KV cache
on, all G completions of a prompt in one generate call) are observed. Times are not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, tmp_path: Path) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _first_cells(table: str) -> list[str]:
    return [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]


def test_preference_benchmark_rows(tmp_path):
    out = _run("preference_throughput.py", "--no-peer", tmp_path=tmp_path)
    dpo, orpo = out.split("# ORPO")
    assert _first_cells(dpo) == ["impl", "live", "precompute"]
    assert _first_cells(orpo) == ["impl", "ours"]
    assert out.count("peer grimoire-rl 2.1.3 skipped") == 2


def test_rollout_benchmark_split_and_engine_checks(tmp_path):
    out = _run("rollout_throughput.py", tmp_path=tmp_path)
    parts = _first_cells(out)
    assert parts == ["part", "generation", "old_policy", "reference", "other_rollout", "train"]
    assert "KV cache on in every generate call: True" in out
    assert "every call holds all G completions of each of its prompts: True" in out


def test_rollout_engines_table(tmp_path):
    """--engines: every HF variant runs (plain generate, static cache, one prefill per prompt,
    both) and samples what plain generate samples (same seed); no timing asserted."""
    out = _run("rollout_throughput.py", "--engines", tmp_path=tmp_path)
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| hf")]
    assert [r[0].strip() for r in rows] == ["hf", "hf-static", "hf-prefill", "hf-prefill-static"]
    assert all(r[-1].strip() == "True" for r in rows)
    assert len({r[2].strip() for r in rows}) == 1  # the same number of generated tokens
