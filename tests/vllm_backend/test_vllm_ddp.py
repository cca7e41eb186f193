"""Two gloo processes, each with its own colocated vLLM engine over its own prompts, against one
process over the same global batch: both ranks sync their engines after every step, own
disjoint prompts, sample what the one process samples (request seeds come from the prompt and
the weight version, not from the rank), and end with the same weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.train_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "vllm_online.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _records(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_two_processes_each_with_an_engine_match_one_process(vllm_tiny, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run = dict(check=True, env=_env(), timeout=600)
    subprocess.run([sys.executable, str(WORKER), str(vllm_tiny), str(one), "4"], **run)
    launch = [
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
        "--main_process_port",
        str(free_port()),
    ]
    subprocess.run([*launch, str(WORKER), str(vllm_tiny), str(two), "2"], **run)

    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    steps = len(single["sampled"])
    for r in (single, *ranks):
        assert r["syncs_in_training"] == steps  # the start, then after every step but the last
        assert r["syncs"] == steps + 1  # ... and the last, before sampling after training
        assert r["gap"] <= 1e-3  # vLLM's log-probs are the trained policy's, on every rank
    for step in range(steps):
        a, b = set(ranks[0]["sampled"][step]), set(ranks[1]["sampled"][step])
        assert a and b and not a & b  # each rank samples its own prompts
        assert a | b == set(single["sampled"][step])

    r1, r2 = _records(one), _records(two)
    print(
        json.dumps(
            [[x["rewards/mean"], y["rewards/mean"], x["loss"], y["loss"]] for x, y in zip(r1, r2)]
        )
    )
    assert len(r1) == len(r2) == steps
    for x, y in zip(r1, r2):  # the same samples and rewards, the same objective
        assert math.isclose(x["rewards/mean"], y["rewards/mean"], abs_tol=1e-6)
        assert math.isclose(x["loss"], y["loss"], abs_tol=1e-5)
    assert single["moved"] > 1e-3  # it trained
    for name, value in single["params"].items():
        assert math.isclose(value, ranks[0]["params"][name], rel_tol=1e-4, abs_tol=1e-4)
        assert ranks[0]["params"][name] == ranks[1]["params"][name]
