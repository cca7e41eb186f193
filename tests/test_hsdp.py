"""Hybrid sharding (HSDP) through torch's own ``fully_shard(mesh=...)``, on CPU (gloo).

``fsdp_shard_group_size=2`` on 4 processes is a 2 x 2 device mesh: every parameter is sharded
over 2 consecutive ranks and replicated across the 2 groups. The runs are those of
tests/test_fsdp2.py (tests/scripts/fsdp_parity.py: 3 SGD steps, global batch 8 rows, token
budget on) with the setting added through ``PARITY_CONFIG``; what the tests check is read from
the trained objects (each parameter's placements, mesh and local shape; the gathered weights),
not from the config.

DCP checkpoints cross layouts both ways: the HSDP run's step-2 checkpoint resumes on 2 flat
FSDP2 processes, and a flat FSDP2 step-2 checkpoint resumes on 4 HSDP processes; both must end
with the uninterrupted 1-process weights.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port
from tests.scripts import fsdp_parity
from tests.test_distributed import _env

from grimoire import GrimoireTrainer, TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.parallel.fsdp import check_shard_group, is_sharded

SCRIPT = Path(fsdp_parity.__file__)
FAMILIES = ["sft", "dpo"]
HSDP = {"fsdp_shard_group_size": 2}
#: Rows per process and micro-batch for each world size: the global batch is 8 rows everywhere
#: (2 accumulation steps).
BATCH = {1: 4, 2: 2, 4: 1}


def _run(tiny_dir, out: Path, families, nproc: int, *extra, config: dict | None = None) -> None:
    """``fsdp_parity.py`` on ``nproc`` processes (torchrun; 1: a plain process, DDP mode)."""
    args = [str(SCRIPT), str(tiny_dir), str(out), ",".join(families)]
    args += ["fsdp2" if nproc > 1 else "ddp", str(BATCH[nproc]), "2", *map(str, extra)]
    cmd = [sys.executable, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--master-port", str(free_port()), *args]
    env = {**_env(), "PARITY_CONFIG": json.dumps(config or {})}
    subprocess.run(cmd, check=True, env=env, timeout=600)


def _result(folder: Path, rank: int = 0) -> dict:
    return json.loads((folder / f"result.rank{rank}.json").read_text())


def _same_params(a: Path, b: Path) -> None:
    pa = torch.load(a / "params.pt", weights_only=True)
    pb = torch.load(b / "params.pt", weights_only=True)
    assert pa.keys() == pb.keys()
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hsdp")
    _run(tiny_dir, root / "one", FAMILIES, 1)
    # HSDP, 3 steps, with a checkpoint at step 2 (save_steps) that the next run resumes from.
    _run(tiny_dir, root / "hsdp", FAMILIES, 4, config={**HSDP, "save_steps": 2})
    shutil.copytree(root / "hsdp/sft/checkpoint-2", root / "hsdp_to_flat/sft/checkpoint-2")
    _run(tiny_dir, root / "hsdp_to_flat", ["sft"], 2, "resume")
    # Flat FSDP2 stops at step 2 with a checkpoint; HSDP resumes it to step 3.
    _run(tiny_dir, root / "flat_to_hsdp", ["sft"], 2, 2)
    _run(tiny_dir, root / "flat_to_hsdp", ["sft"], 4, "resume", config=HSDP)
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_hsdp_shards_within_a_group_and_replicates_across(runs, family):
    """Every trainable weight is a DTensor on the 2 x 2 mesh of ranks ``[[0, 1], [2, 3]]``,
    placed ``(Replicate(), Shard(0))``: the ranks of one shard group hold one half of dim 0
    each, and ranks 0 and 2 (1 and 3) hold the same half."""
    for rank in range(4):
        result = _result(runs / "hsdp" / family, rank)
        assert result["sharded"]
        for name, p in result["params"].items():
            assert p["type"] == "DTensor", name
            assert p["mesh"] == {"dims": ["replicate", "shard"], "ranks": [[0, 1], [2, 3]]}
            assert p["placements"] == ["Replicate()", "Shard(dim=0)"], name
            rows = math.ceil(p["full"][0] / 2)  # 1/2 of the rows: the group size, not 1/4
            want = rows if rank % 2 == 0 else p["full"][0] - rows
            assert p["local"] == [want, *p["full"][1:]], (name, p)
    if family == "dpo":  # the frozen reference is sharded on the policy's very mesh
        for rank in range(4):
            result = _result(runs / "hsdp" / family, rank)
            assert result["reference_placements"] == ["(Replicate(), Shard(dim=0))"]
            assert result["reference_on_policy_mesh"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hsdp_matches_one_process(runs, family):
    losses = _result(runs / "one" / family)["losses"]
    assert len(losses) == 3
    for rank in range(4):  # every rank logs the same (globally reduced) losses
        assert _result(runs / "hsdp" / family, rank)["losses"] == pytest.approx(losses, rel=1e-5)
    _same_params(runs / "hsdp" / family, runs / "one" / family)


def test_hsdp_checkpoint_resumes_on_flat_fsdp2(runs):
    """4 HSDP processes' step-2 checkpoint, resumed by 2 flat FSDP2 processes (rows sharded
    over both, one mesh dimension), ends as the uninterrupted run."""
    assert (runs / "hsdp/sft/checkpoint-2/dcp").is_dir()
    result = _result(runs / "hsdp_to_flat/sft")
    assert all(p["placements"] == ["Shard(dim=0)"] for p in result["params"].values())
    want = _result(runs / "one/sft")["losses"][2:]
    assert result["losses"] == pytest.approx(want, rel=1e-5)
    _same_params(runs / "hsdp_to_flat/sft", runs / "one/sft")


def test_flat_fsdp2_checkpoint_resumes_on_hsdp(runs):
    assert (runs / "flat_to_hsdp/sft/checkpoint-2/dcp").is_dir()
    result = _result(runs / "flat_to_hsdp/sft", 3)
    assert all(p["mesh"]["dims"] == ["replicate", "shard"] for p in result["params"].values())
    want = _result(runs / "one/sft")["losses"][2:]
    assert result["losses"] == pytest.approx(want, rel=1e-5)
    _same_params(runs / "flat_to_hsdp/sft", runs / "one/sft")


def test_shard_group_size_is_validated_up_front():
    with pytest.raises(ConfigError, match="fsdp_shard_group_size must be > 0"):
        TrainingConfig(distributed="fsdp2", fsdp_shard_group_size=0)
    with pytest.raises(ConfigError, match="set distributed to 'fsdp2'"):
        TrainingConfig(fsdp_shard_group_size=8)  # distributed defaults to "ddp"
    TrainingConfig(distributed="fsdp2", fsdp_shard_group_size=8)  # the world size comes later
    check_shard_group(2, 4)
    check_shard_group(None, 3)
    with pytest.raises(ConfigError, match=r"fsdp_shard_group_size=3 does not divide the 4"):
        check_shard_group(3, 4)


def test_trainer_refuses_a_group_size_that_does_not_divide_the_world(
    tiny_model, tokenizer, sft_rows, tmp_path
):
    """One process cannot form groups of 2: refused when the trainer starts, before any sharding."""
    config = TrainingConfig(
        output_dir=str(tmp_path), distributed="fsdp2", fsdp_shard_group_size=2, max_steps=1
    )
    with pytest.raises(ConfigError, match="does not divide the 1 processes"):
        GrimoireTrainer(tiny_model, tokenizer, config, SFTLoss(), sft_rows)
    assert not is_sharded(tiny_model)
