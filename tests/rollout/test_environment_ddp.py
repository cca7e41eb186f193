"""GRPO with ``tools=[lookup]`` on episodes under 2 CPU processes (gloo, ``accelerate launch``)
against 1 process over the same global batch. A scripted turn sampler
(``tests/scripts/episodes_online.py``) makes every episode depend only on its prompt and its place
in the group, so both runs play the same episodes: each rank plays its own prompts, and the
step's gradient (the plain-SGD update) equals the one-process step's: padded, packed under a
token budget that counts every episode token, and with FSDP2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.train_utils import gloo_launch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "episodes_online.py"
G, EPISODE_TOKENS = 4, 256
BUDGET = 2 * G * EPISODE_TOKENS  # two groups of whole episodes per micro-batch at most


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _launch(*args: str, processes: int, distributed: str = "ddp") -> None:
    cmd = [sys.executable, str(WORKER), *args]
    if processes > 1:
        cmd = [*gloo_launch(processes), str(WORKER), *args]
    env = {**_env(), "EPISODES_DISTRIBUTED": distributed}
    subprocess.run(cmd, check=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("episodes-1")
    _launch(str(tiny_dir), str(out), "4", "0", "0", processes=1)
    return json.loads((out / "rank0.json").read_text())


def _two(tiny_dir, out: Path, packed: bool, budget: int, distributed: str = "ddp") -> list[dict]:
    _launch(
        str(tiny_dir),
        str(out),
        "2",
        str(int(packed)),
        str(budget),
        processes=2,
        distributed=distributed,
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _assert_same_step(single: dict, ranks: list[dict]) -> None:
    assert [r["world"] for r in ranks] == [2, 2]  # really two processes
    a, b = set(ranks[0]["played"]), set(ranks[1]["played"])
    assert a and b and not a & b  # each rank plays its own prompts
    assert a | b == set(single["played"])
    assert single["moved"] > 1e-3  # the step trained
    for name, value in single["update"].items():  # SGD at lr 1: the update is the gradient
        assert math.isclose(value, ranks[0]["update"][name], rel_tol=1e-4, abs_tol=1e-6), name
        assert ranks[0]["update"][name] == ranks[1]["update"][name]  # the ranks agree


def test_environment_tools_two_processes_step_equals_one_process(one_process, tiny_dir, tmp_path):
    _assert_same_step(one_process, _two(tiny_dir, tmp_path, packed=False, budget=0))


def test_environment_tools_two_processes_packed_under_episode_token_budget(
    one_process, tiny_dir, tmp_path
):
    ranks = _two(tiny_dir, tmp_path, packed=True, budget=BUDGET)
    _assert_same_step(one_process, ranks)
    for rank in ranks:
        # The budget is counted in whole episodes (G x max_episode_tokens a prompt): a rank's 2
        # prompts (2 x 4 x 256 = the budget) fit one micro-batch, and it holds every episode token.
        assert [m["prompts"] for m in rank["micro"]] == [2]
        assert all(0 < m["tokens"] <= BUDGET for m in rank["micro"])


def test_environment_tools_two_processes_fsdp2_step_equals_one_process(
    one_process, tiny_dir, tmp_path
):
    # FSDP2 shards the model over the two ranks; the worker gathers each whole tensor.
    _assert_same_step(
        one_process, _two(tiny_dir, tmp_path, packed=False, budget=0, distributed="fsdp2")
    )
