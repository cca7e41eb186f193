"""Online RL statistics do not depend on how a step is split (issue: 1 x 4 micro-batches,
1 x 1 of 4 prompts, and 2 processes x 2 micro-batches, with DDP and with FSDP2, give the same
advantages, loss and parameters after one step). Sampling is made deterministic by tests/scripts/online_invariance.py
so that only the method's statistics and normalisers could make the splits differ.

GRPO's ``loss_type="bnpo"`` is left out on purpose: it normalises by each micro-batch's own
token count (as TRL's bnpo does), so it depends on the split by definition (docs/online-rl.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port
from tests.scripts import online_invariance
from tests.test_distributed import LAUNCH, _env

NAMES = list(online_invariance.methods())
SCRIPT = Path(online_invariance.__file__)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for layout, (batch, accum) in {"1x4": (1, 4), "1x1": (4, 1)}.items():
        out[layout] = tmp_path_factory.mktemp(layout)
        online_invariance.run(str(tiny_dir), str(out[layout]), batch, accum, NAMES)
    for layout, mode in (("2x2", "ddp"), ("2x2-fsdp2", "fsdp2")):
        out[layout] = tmp_path_factory.mktemp(layout)
        cmd = [*LAUNCH, "--main_process_port", str(free_port()), str(SCRIPT), str(tiny_dir)]
        env = {**_env(), "INVARIANCE_DISTRIBUTED": mode}
        subprocess.run([*cmd, str(out[layout]), "1", "2"], check=True, env=env, timeout=600)
    return out


def _result(folder: Path, name: str) -> tuple[dict, float, dict]:
    ranks = sorted(folder.glob(f"{name}.rank*.json"))
    advantages: dict[str, list[float]] = {}
    losses = []
    for f in ranks:
        data = json.loads(f.read_text())
        advantages.update(data["advantages"])
        losses.append(data["loss"])
    assert len(set(losses)) == 1, "every rank logs the same (all-reduced) loss"
    return advantages, losses[0], torch.load(folder / f"{name}.params.pt", weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_same_step_however_it_is_split(runs, name):
    base_adv, base_loss, base_params = _result(runs["1x1"], name)
    start = None
    for layout in ("1x4", "2x2", "2x2-fsdp2"):
        adv, loss, params = _result(runs[layout], name)
        assert adv.keys() == base_adv.keys()
        for prompt, a in base_adv.items():
            torch.testing.assert_close(
                torch.tensor(adv[prompt]), torch.tensor(a), rtol=1e-5, atol=1e-6, msg=prompt
            )
        assert loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7)
        for key, p in base_params.items():
            torch.testing.assert_close(params[key], p, rtol=1e-5, atol=1e-6, msg=key)
        start = start or params
    if name != "raft" and name != "online_dpo":
        assert base_adv, "advantages were recorded"
