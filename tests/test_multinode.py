"""Two nodes, simulated on localhost: two separate launchers, one process each, form one gloo
group and train exactly what one launcher with 2 processes (and 1 process) trains.

Each "node" is its own launcher process started concurrently, as on a real cluster where every
machine runs the same command. Both reach each other through one rendezvous endpoint on
127.0.0.1, so this exercises the cross-launcher rendezvous and the node/rank bookkeeping, but not
a real network between hosts, GPUs or NCCL. See docs/multi-gpu.md ("Multi-node").
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port

SCRIPT = Path(__file__).parent / "scripts" / "multinode_sft.py"  # ddp_sft.py + rank-<R>.json
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 180  # seconds for one launch (all its launchers together); a run takes ~10 s here


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """End a launcher and its workers (each launcher leads its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_together(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    """Start every launcher at once; fail (and kill all of them) if one fails or time runs out."""
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen, Path]] = []
    problem = None
    try:
        for i, (cmd, env) in enumerate(commands):
            log = logs / f"launcher-{i}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            procs.append((proc, log))
        deadline = time.monotonic() + TIMEOUT
        while problem is None:
            codes = [proc.poll() for proc, _ in procs]
            if all(code == 0 for code in codes):
                return
            if any(code not in (None, 0) for code in codes):
                problem = f"a launcher failed (exit codes {codes})"
            elif time.monotonic() > deadline:
                problem = f"timed out after {TIMEOUT} s (exit codes {codes})"
            else:
                time.sleep(0.2)
    finally:
        for proc, _ in procs:
            _kill_group(proc)
    tails = "\n".join(
        f"--- {log.name}: {shlex.join(cmd)}\n" + "\n".join(log.read_text().splitlines()[-25:])
        for (proc, log), (cmd, _) in zip(procs, commands, strict=True)
    )
    pytest.fail(f"{problem}\n{tails}")


def _torchrun(nnodes: int, nproc: int, port: int, run_id: str, node_rank: int) -> list[str]:
    return [
        *TORCHRUN,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        # c10d ignores --node-rank (it warns; node ranks follow join order); kept as on clusters
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
    ]


def _accelerate(machine_rank: int, port: int) -> list[str]:
    # accelerate's multi-machine launch: torchrun with the *static* rendezvous, node = machine_rank.
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--num_processes",
        "2",  # all machines together
        "--machine_rank",
        str(machine_rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]


def _two_nodes(launcher: str, script_args: list[str], logs: Path) -> None:
    port, run_id = free_port(), f"grimoire-test-{uuid.uuid4().hex[:8]}"
    commands = []
    for node in (0, 1):
        if launcher == "torchrun":
            prefix = _torchrun(2, 1, port, run_id, node_rank=node)
        else:
            prefix = _accelerate(node, port)
        commands.append(
            ([*prefix, *script_args], _env(GRIMOIRE_TEST_LAUNCHER=f"{launcher}-node{node}"))
        )
    _run_together(commands, logs)


def _losses(folder: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _ranks(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]


def _assert_same_training(a: Path, b: Path) -> None:
    pa = torch.load(a / "params.pt", weights_only=True)
    pb = torch.load(b / "params.pt", weights_only=True)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(
            pa[k], pb[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}"
        )
    la, lb = _losses(a), _losses(b)  # 3 lines: only one process (rank 0) wrote metrics
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, abs=1e-4)


def _assert_one_group_across_launchers(folder: Path, launcher: str) -> None:
    ranks = _ranks(folder)
    assert [r["RANK"] for r in ranks] == ["0", "1"], ranks
    # one process from each launcher ("node"), both in the same world of 2
    assert {r["GRIMOIRE_TEST_LAUNCHER"] for r in ranks} == {
        f"{launcher}-node0",
        f"{launcher}-node1",
    }
    assert len({r["pid"] for r in ranks}) == 2
    for r in ranks:
        assert r["WORLD_SIZE"] == "2" and r["GROUP_WORLD_SIZE"] == "2", r
        assert r["LOCAL_WORLD_SIZE"] == "1" and r["LOCAL_RANK"] == "0", r
        assert r["num_processes"] == 2 and r["process_index"] == int(r["RANK"]), r
        assert r["distributed_type"] == "DistributedType.MULTI_CPU", r
        assert r["is_main_process"] == (r["RANK"] == "0"), r
    assert {r["GROUP_RANK"] for r in ranks} == {"0", "1"}  # two nodes
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1
    if launcher == "accelerate":  # static rendezvous: node rank = --machine_rank
        for r in ranks:
            assert r["GRIMOIRE_TEST_LAUNCHER"].endswith(f"node{r['GROUP_RANK']}"), r
    else:
        assert len({r["TORCHELASTIC_RUN_ID"] for r in ranks}) == 1


#: The settings each two-node launch trains (the token budget: rows LPT-balanced across the two
#: nodes' ranks and bin-packed).
CASES = {"padded": {}, "token-budget": {"max_tokens_per_device": 40}}


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory) -> Path:
    """Every case of :data:`CASES` on 1 process (4 rows x 2 accumulation), one start for all:
    ``<out>/case<i>``. (1 vs 2 processes on one node is tests/test_distributed.py's job.)"""
    out = tmp_path_factory.mktemp("multinode-one")
    cmd = [sys.executable, str(SCRIPT), str(tiny_dir), str(out), "4", "2"]
    _run_together([([*cmd, json.dumps(list(CASES.values()))], _env())], out / "logs")
    return out


@pytest.mark.parametrize(
    ("launcher", "case"),
    [("torchrun", "token-budget"), ("accelerate", "padded")],
    ids=["torchrun-c10d-token-budget", "accelerate-static-padded"],
)
def test_two_nodes_match_one_process(tiny_dir, tmp_path, one_process, launcher, case):
    nodes = tmp_path / "two-nodes"
    # per process: batch 2 x accumulation 2 x 2 processes = the 1-process run's 4 x 2
    extra = json.dumps(CASES[case], sort_keys=True)
    args = [str(SCRIPT), str(tiny_dir), str(nodes), "2", "2", extra]
    _two_nodes(launcher, args, tmp_path / "logs")
    _assert_one_group_across_launchers(nodes, launcher)
    assert [r["num_processes"] for r in _ranks(one_process)] == [1]
    _assert_same_training(one_process / f"case{list(CASES).index(case)}", nodes)
