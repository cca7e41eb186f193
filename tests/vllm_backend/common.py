"""What the vLLM tests share."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

#: Passed to save_tiny / build_model: 2 heads of 64 (vLLM's CPU kernels refuse head size 16).
TINY = dict(hidden_size=128, num_layers=2, num_attention_heads=2, num_key_value_heads=2)


def start_server(model, env: dict[str, str], *extra: str):
    """``grimoire vllm-serve --model MODEL --port 0 ...`` started; ``(process, url)`` once it
    prints the address it serves at (fails the test with its output if it does not start)."""
    cmd = [
        sys.executable,
        "-m",
        "grimoire",
        "vllm-serve",
        "--model",
        str(model),
        "--port",
        "0",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "64",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "grimoire vllm-serve: serving" in line:
            return proc, line.rsplit(" at ", 1)[1].strip()
    proc.kill()
    pytest.fail("vllm-serve did not start:\n" + "".join(lines[-40:]))
