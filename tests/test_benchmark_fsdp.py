"""Smoke test of benchmarks/fsdp_memory.py: ``--quick`` runs and its tables hold up.

Worlds 1 and 2 (gloo, one thread per process), a 1.3M-parameter Llama, and part 2's
full-logits cell; about 40 s on 2 cores.
The sizes are read from the live parameters, gradients and optimizer state on each rank, so
FSDP2 on 2 processes must hold about half of what DDP holds, and DDP the same at 1 and 2.
No wall-clock assertions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_benchmark_token_budget import parse_table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fsdp_memory.py"


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text`` (blocks of ``|`` lines), parsed."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip().startswith("|"):
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    return [parse_table("\n".join(b)) for b in blocks if b]


def test_quick_fsdp2_holds_half_of_ddp_per_rank():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    # Part 2's full-logits cell only: the fused cells' largest block is one chunk under DDP and
    # FSDP2 alike, tests/test_fsdp2_fused.py's check on every family (one launch fewer each).
    cmd = [sys.executable, str(SCRIPT), "--quick", "--logits-cells", "fsdp2-full"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("# command: python ")
    assert "# machine: " in text and "torch " in text

    memory, logits = _tables(text)
    cells = {(r["mode"], int(r["processes"])): r for r in memory}
    assert set(cells) == {(m, n) for m in ("ddp", "fsdp2") for n in (1, 2)}

    def state(mode: str, n: int) -> float:
        r = cells[mode, n]
        parts = [float(r[f"{k} MiB/rank"]) for k in ("params", "grads", "optimizer")]
        assert all(p > 0 for p in parts) and float(r["peak RSS MiB/rank"]) > 0
        assert abs(float(r["total MiB/rank"]) - sum(parts)) <= 0.2  # rounding of each cell
        return sum(parts)

    ddp1, ddp2 = state("ddp", 1), state("ddp", 2)
    fsdp1, fsdp2 = state("fsdp2", 1), state("fsdp2", 2)
    assert abs(ddp2 - ddp1) <= 0.05 * ddp1  # DDP replicates everything
    assert 0.4 * ddp2 <= fsdp2 <= 0.7 * ddp2  # FSDP2 on 2 processes holds about half
    assert abs(fsdp1 - ddp1) <= 0.05 * ddp1  # one process: a shard is the whole
    assert cells["fsdp2", 2]["ratio vs DDP same N"].endswith("x")

    # Part 2 (2 processes): the largest logits block observed by a dispatch mode: fused=False,
    # the old fallback, holds the whole packed row of 512 tokens (the fused path: 128 rows).
    cells = [(r["mode"], r["log-prob path"], r["largest logits block (rows x V)"]) for r in logits]
    assert cells == [("fsdp2", "full logits", "512 x 4096")]
    assert "log line" not in text  # no "fused log-probs off ..." on any rank
