"""VLLMEngine on its own: layout, sampler log-probs vs the policy's, sampling settings, syncs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.vllm_backend.common import TINY

from grimoire.errors import ConfigError
from grimoire.forward.completions import completion_logps
from grimoire.model.tiny import build_model
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.vllm_engine import VLLMEngine

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 12, 13]]


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=0, vocab_size=64, **TINY).eval()


@pytest.fixture(scope="module")
def engine(model):
    engine = VLLMEngine(max_new_tokens=8)
    engine.bind(model, PAD, EOS)
    yield engine
    engine.close()  # one engine per process at a time: vLLM's groups are process-wide


def test_layout_and_sampler_logps_equal_the_policys(engine):
    r = engine.generate(PROMPTS, 4)
    assert r.completion_ids.shape[0] == 12 and r.sampler_logps.shape == r.completion_ids.shape
    mask = r.completion_mask.bool()
    for i in range(12):
        n = int(mask[i].sum())
        body = r.completion_ids[i, :n].tolist()
        assert EOS not in body[:-1] and bool(r.truncated[i]) == (body[-1] != EOS)
        assert r.prompt_ids[i, -len(PROMPTS[i // 4]) :].tolist() == PROMPTS[i // 4]
    assert (r.sampler_logps[~mask] == 0).all()
    # fp32 on both sides: vLLM's log-prob of each drawn token is the policy's own.
    assert (r.old_logps - r.sampler_logps).abs().max() < 1e-4


def test_greedy_is_hfs_greedy(engine, model):
    hf = HFGenerateEngine(max_new_tokens=8)
    hf.bind(model, PAD, EOS)
    ours = engine.generate(PROMPTS, 1, greedy=True, with_old_logps=False)
    theirs = hf.generate(PROMPTS, 1, greedy=True, with_old_logps=False)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert ours.sampler_logps is None  # greedy evaluation: nothing to correct


def test_temperature_and_top_k_are_vllms_own(engine, model):
    greedy = engine.generate(PROMPTS, 1, greedy=True, with_old_logps=False)
    plain = engine.sampler
    engine.sampler = replace(plain, top_k=1)  # sampling restricted to the arg max is greedy
    try:
        top1 = engine.generate(PROMPTS, 1, with_old_logps=False)
    finally:
        engine.sampler = plain
    assert torch.equal(top1.completion_ids, greedy.completion_ids)
    # Log-probs of the temperature-scaled distribution on both sides.
    engine.sampler = replace(plain, temperature=0.5)
    try:
        r = engine.generate(PROMPTS, 2)
    finally:
        engine.sampler = plain
    assert (r.old_logps - r.sampler_logps).abs().max() < 1e-4
    logps, _ = completion_logps(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1])
    assert (logps * r.completion_mask - r.sampler_logps).abs().max() > 1e-2  # T=1 differs


def test_syncs_only_when_the_weights_change(engine, model):
    engine.generate(PROMPTS, 2, with_old_logps=False)
    before = engine.syncs
    engine.generate(PROMPTS, 2, with_old_logps=False)
    assert engine.syncs == before  # nothing written since: no sync
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # written in place, as an optimizer step does
    try:
        r = engine.generate(PROMPTS, 2)
        assert engine.syncs == before + 1
        assert (r.old_logps - r.sampler_logps).abs().max() < 1e-4
    finally:
        with torch.no_grad():
            model.lm_head.weight.div_(1.5)


def test_start_leaves_the_process_as_it_was(model, engine):
    engine.close()  # the module's engine is done
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    engine = VLLMEngine(max_new_tokens=4, seed=7)
    engine.bind(model, PAD, EOS)  # vLLM reseeds torch and pins threads: both undone
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)  # still works (vLLM's CPU worker replaces it with a no-op)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-kernel limit")
def test_a_model_vllm_cannot_run_is_a_config_error_at_bind():
    small_heads = build_model("llama", vocab_size=64, hidden_size=64, num_layers=1)  # head size 16
    engine = VLLMEngine(max_new_tokens=4)
    with pytest.raises(
        ConfigError, match=r"vllm cannot run this model \(LlamaForCausalLM.*head_dim"
    ):
        engine.bind(small_heads, PAD, EOS)
    assert engine.llm is None  # what had started is shut down
