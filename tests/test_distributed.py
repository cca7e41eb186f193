"""2 processes (gloo, CPU) end with the same parameters as 1 process over the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port

SCRIPT = Path(__file__).parent / "scripts" / "ddp_sft.py"
ROOT = Path(__file__).resolve().parents[1]
# `--multi_gpu` selects accelerate's torchrun launcher; on a CPU-only machine the trainer then
# forms a gloo process group (`--cpu` would run a single process).
LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _losses(folder: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


#: The settings 2 processes must train as 1 does, each run by the same two launches.
CASES = {
    "padded": {},
    # Token budget: ranks get LPT-balanced, bin-packed micro-batches (a different split from
    # the 1-process run; normalising by the global token count keeps the same objective).
    "token-budget": {"max_tokens_per_device": 40},
    # OSFT: each rank decomposes half of the matrices and broadcasts the factors.
    "osft": {"osft": True, "osft_unfreeze_rank_ratio": 0.5},
    # docs/custom-loss.md's MinimalLoss (tests/test_custom_loss_contract.py's method): its
    # loss_weight makes the accumulated, all-reduced step the 1-process one.
    "custom-loss": {"loss": "docs_minimal"},
}


@pytest.fixture(scope="module")
def launched(tiny_dir, tmp_path_factory) -> Path:
    """Every case of :data:`CASES` in one 1-process run and one 2-process launch (one start
    each rather than one per case)."""
    out = tmp_path_factory.mktemp("ddp")
    launch_one_and_two(tiny_dir, out, list(CASES.values()))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process(launched, case):
    i = list(CASES).index(case)
    assert_same_training(launched / "one" / f"case{i}", launched / "two" / f"case{i}")


def test_a_trainer_after_close_under_a_launcher_is_refused_with_a_message(launched):
    for rank in (0, 1):
        said = (launched / "two" / f"after_close.rank{rank}.txt").read_text()
        assert said.startswith("the launcher started 2 processes, but an earlier trainer"), said
        assert "call close() only on the last trainer of the script" in said


def launch_one_and_two(tiny_dir, out: Path, extra: dict | list[dict]) -> None:
    """``scripts/ddp_sft.py`` on 1 process (4 rows x 2 accumulation) into ``out/one`` and on 2
    (2 rows x 2 accumulation each) into ``out/two``."""
    args = [str(SCRIPT), str(tiny_dir)]
    subprocess.run(
        [sys.executable, *args, str(out / "one"), "4", "2", json.dumps(extra)],
        check=True,
        env=_env(),
        timeout=300,
    )
    subprocess.run(
        [
            *LAUNCH,
            "--main_process_port",
            str(free_port()),
            *args,
            str(out / "two"),
            "2",
            "2",
            json.dumps(extra),
        ],
        check=True,
        env=_env(),
        timeout=300,
    )


def assert_same_training(one: Path, two: Path) -> None:
    a = torch.load(one / "params.pt", weights_only=True)
    b = torch.load(two / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    la, lb = _losses(one), _losses(two)
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, abs=1e-4)
