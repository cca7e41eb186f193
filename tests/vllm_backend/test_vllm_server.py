"""``grimoire vllm-serve`` + ``engine: vllm-server``: a real server process (vLLM's CPU build),
the weight push proven as the colocated sync is (vLLM's log-probs = the policy's after k steps,
and not without the push), and 2 gloo processes sharing one server = 1 process."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from tests.vllm_backend.common import start_server
from tests.vllm_backend.test_vllm_ddp import WORKER, _env, _records
from tests.vllm_backend.test_vllm_sync import K, _run, check_sync

from grimoire.rollout.engines.vllm_server import VLLMServerEngine


def _pushes(url: str, kind: str = "weight_pushes") -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        return json.loads(answer.read())[kind]


@pytest.fixture(scope="module")
def server(vllm_tiny):
    proc, url = start_server(vllm_tiny, _env(), "--max-lora-rank", "8")
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_server_logps_equal_the_policys_after_k_steps_and_differ_without_push(
    vllm_tiny, tmp_path, server, peft
):
    check_sync(vllm_tiny, tmp_path, peft, lambda: VLLMServerEngine(max_new_tokens=8, url=server))


def test_server_adapter_only_lora_sync_loads_base_once_and_one_adapter_per_step(
    vllm_tiny, tmp_path, server
):
    """``lora_sync: adapter`` against the server: one full push (the base), then adapters
    only, counted by the server itself; vLLM's log-probs still equal the policy's."""
    before = _pushes(server), _pushes(server, "adapter_pushes")
    engine = VLLMServerEngine(max_new_tokens=8, url=server)
    gap, syncs, records, _ = _run(vllm_tiny, tmp_path, False, peft=True, engine=engine)
    after = _pushes(server), _pushes(server, "adapter_pushes")
    print(
        json.dumps(
            {
                "server_lora_sync": "adapter",
                "gap": gap,
                "bytes_per_step": [r["weight_sync/bytes"] for r in records],
            }
        )
    )
    assert gap <= 1e-3
    assert (after[0] - before[0], after[1] - before[1]) == (1, syncs) == (1, K + 1)
    assert engine.base_loads == 1


def test_two_processes_sharing_one_server_match_one_process(vllm_tiny, tmp_path, server):
    from tests.helpers.train_utils import free_port

    spec = json.dumps({"type": "vllm-server", "args": {"url": server}})
    one, two = tmp_path / "one", tmp_path / "two"
    run = dict(check=True, env=_env(), timeout=600)
    pushes = [_pushes(server)]
    subprocess.run([sys.executable, str(WORKER), str(vllm_tiny), str(one), "4", spec], **run)
    pushes.append(_pushes(server))
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
    subprocess.run([*launch, str(WORKER), str(vllm_tiny), str(two), "2", spec], **run)
    pushes.append(_pushes(server))
    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    steps = len(single["sampled"])
    for r in (single, *ranks):
        assert r["syncs"] == steps + 1  # a push at the start and after every step
        assert r["gap"] <= 1e-3  # the server holds the trained policy, seen from every rank
    for step in range(steps):
        a, b = set(ranks[0]["sampled"][step]), set(ranks[1]["sampled"][step])
        assert a and b and not a & b and a | b == set(single["sampled"][step])
    # Counted by the server itself: each run pushed steps + 1 times; with 2 ranks rank 0 alone.
    assert [b - a for a, b in zip(pushes, pushes[1:])] == [steps + 1, steps + 1]
    r1, r2 = _records(one), _records(two)
    assert len(r1) == len(r2) == steps
    for x, y in zip(r1, r2):
        assert abs(x["rewards/mean"] - y["rewards/mean"]) <= 1e-6
        assert abs(x["loss"] - y["loss"]) <= 1e-5


def test_async_server_samples_with_the_version_whose_log_probs_are_the_old_ones(
    vllm_tiny, tmp_path, server, monkeypatch
):
    """``max_staleness: 1`` against the real server: each trained batch was drawn by vLLM
    holding the SAMPLER's version (vLLM's log-probs = that version's old log-probs, <= 1e-3),
    one step behind the learner (its log-probs are further off), counted pushes included."""
    import time

    import torch
    from tests.helpers.train_utils import quiet_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer
    from grimoire.forward.completions import batch_completion_logps
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import reverse_rows
    from grimoire.rows.prompts import tokenize_grpo
    from grimoire.training.callbacks import TrainerCallback

    class Slow(TrainerCallback):  # keeps the producer one step ahead
        def __init__(self):
            self.metrics, self.versions = [], {}

        def on_step_end(self, trainer, step, loss, metrics) -> None:
            time.sleep(0.5)
            self.metrics.append(dict(metrics))
            state = trainer.unwrapped_model.state_dict()
            self.versions[step] = {k: v.clone() for k, v in state.items()}

    batches = []
    compute = GRPOMethod.compute_loss

    def recording(self, model, batch):
        batches.append((self._ctx.step.global_step, dict(batch)))
        return compute(self, model, batch)

    monkeypatch.setattr(GRPOMethod, "compute_loss", recording)
    tok = AutoTokenizer.from_pretrained(vllm_tiny)
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(16, seed=1)]
    slow = Slow()
    slow.versions[0] = {k: v.clone() for k, v in model.state_dict().items()}
    method = GRPOMethod(
        ["char_match"],
        num_generations=4,
        max_staleness=1,
        max_new_tokens=8,
        engine={"type": "vllm-server", "args": {"url": server}},
    )
    config = quiet_config(tmp_path, max_steps=4, learning_rate=1e-2, disable_dropout=True)
    before = _pushes(server)
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=rows,
        callbacks=[slow],
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert [m["staleness/max"] for m in slow.metrics] == [0.0, 1.0, 1.0, 1.0]
    # Counted by the server: versions 0 (steps 0 and 1), 1, 2; 3 if the producer sampled a
    # step past the last before it was stopped. The learner's engine never pushed.
    assert _pushes(server) - before in (3, 4)
    probe = AutoModelForCausalLM.from_pretrained(vllm_tiny)
    gaps = []
    for step, batch in batches:
        mask = batch["completion_mask"].bool()
        gap = float((batch["old_logps"] - batch["sampler_logps"]).abs()[mask].max())
        assert gap <= 1e-3, (step, gap)
        probe.load_state_dict(slow.versions[step])  # the learner's weights at that step
        with torch.no_grad():
            learner, _ = batch_completion_logps(probe, batch, 1.0, fused=False)
        gaps.append(float((learner - batch["sampler_logps"]).abs()[mask].max()))
    print(json.dumps({"async_server_learner_gaps": gaps}))
    assert all(g > 1e-3 for g in gaps[1:])  # one step of training moves them past that
