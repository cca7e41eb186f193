"""FSDP2 through torch's own ``fully_shard``, verified on CPU (gloo): the parameters really are
sharded, training matches DDP and one process, and DCP checkpoints resume across world sizes
and layouts; hybrid sharding (HSDP) on a 2 x 2 mesh.

The script (tests/scripts/fsdp_parity.py) runs 3 optimizer steps (SGD, token budget on) of SFT,
DPO with a frozen reference model, LoRA SFT, OSFT and SFT of an untied-embedding model, and
exports the SFT models with ``save_model``; what it records is read from the trained
objects themselves (each parameter's type, placements, mesh and the shape this process holds;
the gathered full weights), not from the planner or the config.

``fsdp_shard_group_size=2`` on 4 processes is a 2 x 2 device mesh: every parameter is sharded
over 2 consecutive ranks and replicated across the 2 groups. DCP checkpoints cross world sizes
and layouts both ways (FSDP2 on 2 processes <-> 1 process, HSDP on 4 <-> flat FSDP2 on 2); each
resumed run must end with the uninterrupted 1-process weights. The runs share their launches
(:func:`runs`): a launch's imports and process-group start-up are most of its time.
"""

from __future__ import annotations

import json
import math
import os
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
FAMILIES = ["sft", "dpo", "lora", "osft", "sft_untied"]
HSDP_FAMILIES = ["sft", "dpo"]
HSDP = {"fsdp_shard_group_size": 2}


def _launch(
    tiny_dir, out: Path, families, mode: str, batch: int, accum: int, *extra, nproc=2, env=None
):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(SCRIPT), str(tiny_dir), str(out)]
    cmd += [",".join(families), mode, str(batch), str(accum), *map(str, extra)]
    subprocess.run(cmd, check=True, env={**_env(), **(env or {})}, timeout=600)


def _one(tiny_dir, out: Path, family: str, *extra, env=None):
    cmd = [sys.executable, str(SCRIPT), str(tiny_dir), str(out), family, "ddp", "4", "2"]
    subprocess.run([*cmd, *map(str, extra)], check=True, env={**_env(), **(env or {})}, timeout=600)


def _result(folder: Path, rank: int = 0) -> dict:
    return json.loads((folder / f"result.rank{rank}.json").read_text())


def _same_params(a: Path, b: Path, rtol: float = 1e-5) -> None:
    pa = torch.load(a / "params.pt", weights_only=True)
    pb = torch.load(b / "params.pt", weights_only=True)
    assert pa.keys() == pb.keys()
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], rtol=rtol, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory) -> Path:
    """Every run of this file's tests but the preemption ones, in 4 launches and 1 process:

    1. 2 processes: every family on FSDP2, then on DDP (``fsdp2/``, ``ddp/``; FAMILIES and the
       bf16 and Muon runs), then Muon's sharded step on the same group (``muon.rank<r>.json``);
    2. 1 process: FAMILIES and Muon (``one/``; the same global batch of 8 rows), then it
       resumes FSDP2's step-2 checkpoint to step 3 (``2to1/``);
    3. 4 processes, HSDP: SFT and DPO (``hsdp/``), then they resume flat FSDP2's step-2
       checkpoint (``flat_to_hsdp/``);
    4. 2 processes, flat FSDP2: resume the 1-process (``1to2/``) and the HSDP (``hsdp_to_flat/``)
       step-2 checkpoints.

    SFT checkpoints at step 2 in every first run (``SAVE_SFT_AT``); a resumed run starts from a
    copy of that checkpoint in a folder of its own."""
    root = tmp_path_factory.mktemp("fsdp")

    def copy(src: str, dest: str) -> str:
        shutil.copytree(root / src / "sft/checkpoint-2", root / dest / "sft/checkpoint-2")
        return str(root / dest)

    save = {"SAVE_SFT_AT": "2"}
    families = [*FAMILIES, "sft_bf16", "muon"]
    _launch(tiny_dir, root, families, "fsdp2,ddp", 2, 2, env={**save, "MUON_SHARDED": "1"})
    resume = {"THEN_RESUME": copy("fsdp2", "2to1")}
    _one(tiny_dir, root / "one", ",".join([*FAMILIES, "muon"]), env={**save, **resume})
    hsdp = {**save, "PARITY_CONFIG": json.dumps(HSDP), "THEN_RESUME": copy("fsdp2", "flat_to_hsdp")}
    _launch(tiny_dir, root / "hsdp", HSDP_FAMILIES, "fsdp2", 1, 2, nproc=4, env=hsdp)
    flat = {"THEN_RESUME": copy("hsdp", "hsdp_to_flat")}
    copy("one", "1to2")
    _launch(tiny_dir, root / "1to2", ["sft"], "fsdp2", 2, 2, "resume", env=flat)
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_shards_every_trainable_weight(runs, family):
    for rank in (0, 1):
        result = _result(runs / "fsdp2" / family, rank)
        assert result["sharded"]
        assert result["fused_log"] == []  # the fused head ran: no "fused log-probs off" line
        for name, p in result["params"].items():
            assert p["type"] == "DTensor", name  # a DDP fallback would hold plain tensors
            rows = math.ceil(p["full"][0] / 2)
            want = rows if rank == 0 else p["full"][0] - rows
            assert p["local"] == [want, *p["full"][1:]], (name, p)
    assert not _result(runs / "ddp" / family)["sharded"]
    if family == "dpo":  # the frozen reference is sharded the same way
        assert _result(runs / "fsdp2" / family)["reference_sharded"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_matches_ddp_and_one_process(runs, family):
    losses = {m: _result(runs / m / family)["losses"] for m in ("fsdp2", "ddp")}
    losses["one"] = _result(runs / "one" / family)["losses"]
    assert len(losses["one"]) == 3
    for mode in ("fsdp2", "ddp"):
        assert losses[mode] == pytest.approx(losses["one"], rel=1e-5)
        _same_params(runs / mode / family, runs / "one" / family)


def _export(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((folder / "export").glob("*.safetensors"))
    assert files, folder
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", fsdp_parity.EXPORTED)
def test_fsdp2_export_equals_the_one_process_export(runs, family):
    """The ``from_pretrained`` export of FSDP2 (gathered shards) writes the keys and values of
    the 1-process export: a tied lm_head once (not a second copy of the embeddings)."""
    from transformers import AutoModelForCausalLM

    want = _export(runs / "one" / family)
    # The golden file itself: the tied model's export holds no lm_head, the untied one does.
    assert ("lm_head.weight" in want) == (family == "sft_untied")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2]])
    one = AutoModelForCausalLM.from_pretrained(runs / "one" / family / "export")
    with torch.no_grad():
        logits = one(ids).logits
    for mode in ("fsdp2", "ddp"):
        got = _export(runs / mode / family)
        assert sorted(got) == sorted(want), mode
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
        loaded = AutoModelForCausalLM.from_pretrained(runs / mode / family / "export")
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_resume_on_another_world_size_equals_the_uninterrupted_run(runs):
    # 2 processes' (FSDP2) DCP checkpoint of step 2, resumed by 1 process to step 3.
    assert (runs / "fsdp2" / "sft" / "checkpoint-2" / "dcp").is_dir()
    assert _result(runs / "2to1/sft")["steps"] == 3
    assert _result(runs / "2to1" / "sft")["losses"] == pytest.approx(
        _result(runs / "one" / "sft")["losses"][2:], rel=1e-5
    )  # step 3 only: it did resume
    _same_params(runs / "2to1" / "sft", runs / "one" / "sft")
    # 1 process's checkpoint of step 2, resumed by 2 FSDP2 processes to step 3.
    assert len(_result(runs / "1to2/sft")["losses"]) == 1
    _same_params(runs / "1to2" / "sft", runs / "one" / "sft")


def test_sigterm_on_one_rank_leaves_a_resumable_checkpoint(runs, tiny_dir, tmp_path):
    """SIGTERM on rank 1 after step 1: both ranks agree in step 2's all-reduce, checkpoint
    step 2 and exit cleanly; resuming finishes exactly like the uninterrupted run."""
    out = tmp_path / "preempted"
    _launch(tiny_dir, out, ["sft"], "fsdp2", 2, 2, env={"SIGNAL_AT": "1:SIGTERM:1"})
    for rank in (0, 1):
        result = _result(out / "sft", rank)
        assert result["steps"] == 2 and result["preempted_by"] is not None
    assert _result(out / "sft", 1)["preempted_by"] == "SIGTERM"
    assert (out / "sft" / "checkpoint-2" / "dcp").is_dir()
    _launch(tiny_dir, out, ["sft"], "fsdp2", 2, 2, "resume")
    _same_params(out / "sft", runs / "one" / "sft")


def test_second_signal_without_fsdp_one_process(tiny_dir, tmp_path):
    """SIGUSR1 (listed in checkpoint_signals) on a single DDP-mode process: stop right after
    the step it arrived in, with a checkpoint there."""
    out = tmp_path / "usr1"
    _one(tiny_dir, out, "sft", env={"SIGNAL_AT": "2:SIGUSR1:0"})
    result = _result(out / "sft")
    assert result["steps"] == 2 and result["preempted_by"] == "SIGUSR1"
    assert (out / "sft" / "checkpoint-2" / "dcp").is_dir()
    assert os.path.exists(out / "sft" / "checkpoint-2" / "model.safetensors")


def test_fsdp2_bf16_gathers_bf16_weights_and_keeps_fp32_shards(runs):
    """mixed_precision='bf16' becomes FSDP2's MixedPrecisionPolicy: a layer computes with bf16
    weights (seen by a hook inside its forward) while the sharded parameters stay fp32."""
    for rank in (0, 1):
        result = _result(runs / "fsdp2" / "sft_bf16", rank)
        assert result["forward_weight_dtypes"] == ["torch.bfloat16"]
        assert {p["dtype"] for p in result["params"].values()} == {"torch.float32"}
        assert all(math.isfinite(x) for x in result["losses"]) and len(result["losses"]) == 3


def test_fsdp2_muon_step_equals_the_whole_matrix_step(runs):
    """Muon on FSDP2 shards: each matrix is gathered for Newton-Schulz and each process applies
    its slice, so from the same gradients the sharded weights equal torch.optim.Muon's on whole
    matrices (tests/scripts/muon_sharded.py; torch's step on the shards differs by ~1e-3)."""
    for rank in (0, 1):
        record = json.loads((runs / f"muon.rank{rank}.json").read_text())
        muon = {name: p for name, p in record.items() if p["muon"]}
        assert len(muon) == 14  # 7 projections x 2 layers; embeddings and norms on AdamW
        for name, p in record.items():
            assert p["max_rel_diff"] <= 1e-5, (name, p)
        for name, p in muon.items():
            assert p["type"] == p["buffer"] == "DTensor", name  # the momentum stays sharded
            assert p["local"] == [p["full"][0] // 2, p["full"][1]], name


def test_fsdp2_muon_training_matches_one_process(runs):
    """Three Muon steps of SFT on 2 FSDP2 processes give the 1-process losses. Weights are
    compared at the optimizer level above: Newton-Schulz runs in bf16 and amplifies the last-bit
    reduction-order differences of computed gradients (DDP's too) far above 1e-5."""
    fsdp2, one = _result(runs / "fsdp2" / "muon"), _result(runs / "one" / "muon")
    assert fsdp2["sharded"] and {p["type"] for p in fsdp2["params"].values()} == {"DTensor"}
    assert len(one["losses"]) == 3
    assert fsdp2["losses"] == pytest.approx(one["losses"], rel=1e-5)  # torch's step: 3.7e-5 off


# --------------------------------------------------------------------------- HSDP


@pytest.mark.parametrize("family", HSDP_FAMILIES)
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


@pytest.mark.parametrize("family", HSDP_FAMILIES)
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
