"""Freed tensors go back to the OS on a CPU run (model/host_allocator.py), observed in RSS.

Each case runs in a fresh interpreter: glibc's mmap threshold is process-wide and permanent.
The pattern is a step's: one large tensor freed (which, by default, raises glibc's dynamic
threshold), then 40 activation-sized tensors of 4 MiB of which the last stays alive, the way a
tensor made late in a step pins the heap above the earlier, freed ones.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grimoire.model.host_allocator import _mallopt

PROBE = """
import json, sys
import torch
from grimoire.model.host_allocator import return_freed_memory

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

mode = sys.argv[1]
fixed = return_freed_memory() if mode == "fixed" else False
if mode.startswith("trainer"):  # a CPU trainer's set-up, with the setting as the mode says
    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses import SFTLoss
    from grimoire.model.tiny import build_model, build_tokenizer

    setting = {"trainer-on": {"return_freed_memory": True}, "trainer-default": {}}[mode]
    config = TrainingConfig(output_dir=sys.argv[2], max_steps=1, **setting)
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    GrimoireTrainer(build_model(), build_tokenizer(), config, SFTLoss(), rows)
big = torch.ones(16 << 18)  # 16 MiB, freed: by default the threshold rises to 16 MiB
del big
before = rss_mib()
tensors = [torch.ones(1 << 20) for _ in range(40)]  # 40 x 4 MiB, written (resident)
alive = tensors[-1]
del tensors
print(json.dumps({"fixed": fixed, "kept_mib": rss_mib() - before}))
"""


def _kept(mode: str, out_dir: str = "") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, out_dir], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_mallopt() is None, reason="the C library is not glibc (no mallopt)")
def test_freed_activations_stay_resident_by_default_and_return_with_the_fixed_threshold():
    default, fixed = _kept("default"), _kept("fixed")
    # Default glibc: the 39 freed 4 MiB tensors (156 MiB) stay in the heap below the live one.
    assert default["kept_mib"] > 100, default
    # Fixed threshold: each was its own mapping, unmapped when freed; only the live one stays.
    assert fixed["fixed"] is True
    assert fixed["kept_mib"] < 16, fixed


@pytest.mark.skipif(_mallopt() is None, reason="the C library is not glibc (no mallopt)")
def test_a_trainer_returns_freed_memory_when_asked_and_leaves_glibc_alone_by_default(tmp_path):
    assert _kept("trainer-on", str(tmp_path / "on"))["kept_mib"] < 16
    assert _kept("trainer-default", str(tmp_path / "default"))["kept_mib"] > 100
