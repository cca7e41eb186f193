"""The weight sync, proven on vLLM's own numbers: after k optimizer steps of GRPO trained on
vLLM's samples, vLLM's per-token log-probs of what it draws equal the policy's recomputed ones
(fp32, <= 1e-3); with the sync skipped after the first load they do not. Full fine-tuning and
LoRA (merged for the sync)."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig
from tests.helpers.train_utils import RecordLosses, params_of, quiet_config, train
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rollout.engines.vllm_engine import VLLMEngine
from grimoire.rows.prompts import tokenize_grpo

K = 3  # optimizer steps
G = 4


def _run(vllm_tiny, tmp_path, skip_sync: bool, peft: bool = False, engine=None):
    tok = AutoTokenizer.from_pretrained(vllm_tiny)
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(4 * K, seed=1)]
    engine = engine or VLLMEngine(max_new_tokens=8)
    if skip_sync:  # the first load only: vLLM then samples with the starting weights
        sync = engine.sync_weights
        engine.sync_weights = lambda: sync() if engine.syncs == 0 else None
    method = GRPOMethod(["char_match"], num_generations=G, engine=engine)
    start = params_of(model)
    record = RecordLosses()
    lr = 1e-2 if peft else 3e-3
    config = quiet_config(tmp_path, max_steps=K, learning_rate=lr, disable_dropout=True)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = train(
        model,
        tok,
        rows,
        method,
        config,
        callbacks=[record],
        peft_config=peft_config if peft else None,
    )
    policy = trainer.context.unwrapped_model
    moved = max(
        (p.detach() - start[n.replace("base_model.model.", "").replace(".base_layer", "")])
        .abs()
        .max()
        for n, p in policy.named_parameters()
        if "lora_" not in n
        and n.replace("base_model.model.", "").replace(".base_layer", "") in start
    )
    prompts = [r["prompt_input_ids"] for r in rows[:4]]
    rollout = engine.generate(prompts, G)  # old_logps: the policy's, recomputed (fp32)
    mask = rollout.completion_mask.bool()
    gap = float((rollout.old_logps - rollout.sampler_logps).abs()[mask].max())
    trainer.close()
    return gap, engine.syncs, record.records, moved


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_vllm_logps_equal_the_policys_after_k_steps_and_differ_without_sync(
    vllm_tiny, tmp_path, peft
):
    check_sync(vllm_tiny, tmp_path, peft, lambda: None)


def check_sync(vllm_tiny, tmp_path, peft, make_engine):
    """The assertions, for engines from ``make_engine()`` (None: a colocated VLLMEngine)."""
    run = dict(peft=peft)
    gap, syncs, records, moved = _run(
        vllm_tiny, tmp_path / "sync", False, **run, engine=make_engine()
    )
    stale, stale_syncs, _, _ = _run(
        vllm_tiny, tmp_path / "stale", True, **run, engine=make_engine()
    )
    print(json.dumps({"peft": peft, "k": K, "synced_gap": gap, "stale_gap": stale, "syncs": syncs}))
    if not peft:
        assert moved > 1e-3  # the weights did move (LoRA: the base stays, the merge moves)
    assert syncs == K + 1  # the start, after each of the k - 1 steps before a rollout, and now
    assert stale_syncs == 1
    assert gap <= 1e-3
    assert stale > 1e-2
    # The importance-sampling correction is on and logged; in fp32 it is (nearly) the identity.
    assert len(records) == K
    for r in records:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
        assert r["sampling/importance_sampling_ratio/clipped_frac"] == 0.0


def test_vllm_adapter_only_lora_sync_logps_equal_the_policys_and_base_loaded_once(
    vllm_tiny, tmp_path
):
    """``lora_sync: adapter``: vLLM loads the base weights once and then only the adapter per
    step; its log-probs still equal the policy's after k steps, and far fewer bytes go out per
    step than with ``lora_sync: merged`` (both printed)."""
    engines = {m: VLLMEngine(max_new_tokens=8, lora_sync=m) for m in ("adapter", "merged")}
    sent = {}
    for mode, engine in engines.items():
        gap, syncs, records, _ = _run(vllm_tiny, tmp_path / mode, False, peft=True, engine=engine)
        sent[mode] = [r["weight_sync/bytes"] for r in records]
        print(
            json.dumps(
                {
                    "lora_sync": mode,
                    "gap": gap,
                    "syncs": syncs,
                    "base_loads": engine.base_loads,
                    "bytes_per_step": sent[mode],
                    "merged_bytes": records[-1]["weight_sync/merged_bytes"],
                }
            )
        )
        assert gap <= 1e-3
        assert syncs == K + 1
        assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3 for r in records)
    adapter, merged = engines["adapter"], engines["merged"]
    assert adapter.base_loads == 1 and adapter.adapter_pushes == K + 1
    assert merged.base_loads == K + 1 and merged.adapter_pushes == 0
    # After the first sync (base + adapter) every adapter push is the same size, and smaller.
    assert sent["adapter"][1:] == [sent["adapter"][1]] * (K - 1)
    assert sent["adapter"][1] * 10 < sent["merged"][1] == sent["merged"][0]
