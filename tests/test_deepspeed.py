"""DeepSpeed ZeRO-2 and ZeRO-3 through accelerate, run on 2 CPU processes (gloo): SFT and DPO
with a frozen reference model train like DDP on 2 processes, export the same model, and resume
from a mid-run checkpoint exactly.

tests/scripts/deepspeed_parity.py runs 3 optimizer steps (AdamW, linear decay, clipping active,
2 micro-batches per step) of each family, checkpointing at step 2, under ``accelerate launch``
with a DeepSpeed config written here (the settings of examples/accelerate/deepspeed_zero*.yaml
with 2 processes) or with ``--multi_gpu`` (DDP). In each ZeRO launch, a fresh trainer (a newly
loaded model, a new engine) then resumes each run from its checkpoint: 3 launches in all, not 5
(every process start with torch, transformers and deepspeed costs seconds). What it records is
read from the trained objects (wrapper types, the weights each process holds, the trainer's own
export), not from the config.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.deepspeed_launch import deepspeed_launcher
from tests.helpers.train_utils import free_port
from tests.scripts import deepspeed_parity
from tests.test_distributed import LAUNCH, _env

from grimoire import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import GRPOMethod
from grimoire.parallel.deepspeed import (
    check_deepspeed,
    configure_deepspeed,
    start_deepspeed_on_cpu,
)
from grimoire.training.setup import build_rollouts

SCRIPT = Path(deepspeed_parity.__file__)
FAMILIES = ["sft", "dpo"]
STAGES = [2, 3]


def _launch(tiny_dir, out: Path, mode: str, *extra: str) -> None:
    if mode == "ddp":
        launcher = [*LAUNCH, "--main_process_port", str(free_port())]
    else:
        launcher = deepspeed_launcher(int(mode[-1]), 2, out.parent)
    cmd = [*map(str, launcher), str(SCRIPT)]
    cmd += [str(tiny_dir), str(out), ",".join(FAMILIES), *extra]
    subprocess.run(cmd, check=True, env=_env(), timeout=600)


def _result(folder: Path, rank: int = 0) -> dict:
    return json.loads((folder / f"result.rank{rank}.json").read_text())


def _params(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "params.pt", weights_only=True)


def _same_params(a: Path, b: Path) -> None:
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)  # the export's keys: a tied lm_head once, or not at all
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepspeed")
    _launch(tiny_dir, root / "ddp", "ddp")
    for mode in ("zero2", "zero3"):  # each run, then its resumed run, in one launch
        _launch(tiny_dir, root / mode, mode, "resume")
    return root


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_deepspeed_engine_runs_the_training(runs, stage, family):
    """Both processes trained through a DeepSpeed engine, ZeRO-3 holding half of each weight,
    the DPO reference partitioned like the policy under ZeRO-3 and replicated under ZeRO-2."""
    for rank in (0, 1):
        result = _result(runs / f"zero{stage}" / family, rank)
        assert result["distributed_type"] == "DistributedType.DEEPSPEED"
        assert result["wrapper"] == "DeepSpeedEngine" and result["num_processes"] == 2
        assert result["steps"] == 3
        want = pytest.approx(0.5, abs=0.01) if stage == 3 else 1.0
        assert result["held"] == want
        if family == "dpo":
            assert result["reference_held"] == want
            wrapper = "DeepSpeedEngine" if stage == 3 else "LlamaForCausalLM"
            assert result["reference_wrapper"] == wrapper
    assert _result(runs / "ddp" / family)["wrapper"] == "DistributedDataParallel"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_deepspeed_matches_ddp(runs, stage, family):
    """Losses and grad norms of every step, the final evaluation and the exported weights
    equal DDP's (1e-5)."""
    ds, ddp = _result(runs / f"zero{stage}" / family), _result(runs / "ddp" / family)
    assert len(ddp["losses"]) == 3
    assert ds["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    # the norm before clipping; max_grad_norm=0.2 clipped every step (DeepSpeed's clipping)
    assert ds["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-5)
    assert min(ddp["grad_norms"]) > 0.2
    assert ds["eval"] and ds["eval"] == pytest.approx(ddp["eval"], rel=1e-5)
    _same_params(runs / f"zero{stage}" / family, runs / "ddp" / family)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_deepspeed_resume_equals_the_uninterrupted_run(runs, stage, family):
    """A fresh trainer and engine resume the engine's checkpoint of step 2 and end where the run
    did: only step 3 is trained again."""
    run = runs / f"zero{stage}" / family
    checkpoint = run / "checkpoint-2"
    assert (checkpoint / "deepspeed").is_dir() and not (checkpoint / "dcp").exists()
    resumed = _result(run / "resumed")
    assert _result(run)["logged_steps"] == [1, 2, 3]
    assert resumed["steps"] == 3 and resumed["logged_steps"] == [3]
    assert resumed["losses"] == pytest.approx(_result(run)["losses"][2:], rel=1e-5)
    assert resumed["eval"] == pytest.approx(_result(run)["eval"], rel=1e-5)
    _same_params(run / "resumed", run)


def test_deepspeed_export_loads_like_the_ddp_export(runs):
    """ZeRO-3's export (gathered partitions) loads with from_pretrained to DDP's logits."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2]])
    logits = {}
    for mode in ("ddp", "zero3"):
        model = AutoModelForCausalLM.from_pretrained(runs / mode / "sft" / "export")
        with torch.no_grad():
            logits[mode] = model(ids).logits
    torch.testing.assert_close(logits["zero3"], logits["ddp"], rtol=1e-5, atol=1e-5)


class _Plugin:
    def __init__(self, config: dict) -> None:
        self.deepspeed_config = config


class _Accelerator:
    """What configure_deepspeed / check_deepspeed read of an Accelerator."""

    def __init__(self, config: dict | None) -> None:
        self.state = type("State", (), {"deepspeed_plugin": config and _Plugin(config)})()


def test_deepspeed_config_follows_the_training_config(tmp_path):
    config = TrainingConfig(output_dir=str(tmp_path), batch_size=3, max_grad_norm=0.5)
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
    }
    configure_deepspeed(_Accelerator(ds), config)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and "train_batch_size" not in ds
    assert ds["gradient_accumulation_steps"] == 1  # the trainer accumulates micro-batches
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    unclipped = {"gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8}
    configure_deepspeed(_Accelerator(unclipped), TrainingConfig(max_grad_norm=None))
    assert unclipped["gradient_clipping"] == 0.0  # DeepSpeed's "no clipping"
    assert unclipped["train_micro_batch_size_per_gpu"] == 8  # an explicit size is kept


def test_deepspeed_refuses_what_cannot_run_under_an_engine(tmp_path):
    accelerator = _Accelerator({"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="osft"):
        check_deepspeed(accelerator, TrainingConfig(output_dir=str(tmp_path), osft=True))
    with pytest.raises(ConfigError, match="fsdp2"):
        check_deepspeed(accelerator, TrainingConfig(distributed="fsdp2"))
    check_deepspeed(_Accelerator(None), TrainingConfig(osft=True))  # not DeepSpeed: no say


def test_deepspeed_refuses_generation_under_zero3():
    method = GRPOMethod(["exact_match"])
    context = type(
        "Context", (), {"accelerator": _Accelerator({"zero_optimization": {"stage": 3}})}
    )
    with pytest.raises(ConfigError, match="ZeRO-3"):
        build_rollouts(method, context())


def test_deepspeed_is_started_only_when_launched_for_it(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert start_deepspeed_on_cpu() is False  # a plain launch: accelerate's own gloo group
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("LOCAL_RANK")
    assert start_deepspeed_on_cpu() is False  # no launcher: nothing to form a group with
