"""The colocated vLLM engine's own code path, run against a stand-in ``vllm`` module (the real
one is not installed here; tests/vllm_backend runs it): the shared base's set-up at ``bind``,
one weight load per weight version, ``SamplingParams`` one to one from the engine's sampler,
per-request seeds, the sampler's log-probs, and the shutdown."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import pytest
import torch

import grimoire.rollout.engines.vllm_engine as vllm_engine
from grimoire.rollout.engines.vllm_engine import VLLMEngine


class _LLM:
    """Records what the engine asks of vLLM; completion ``i`` of a prompt is ``[last + 1 + i,
    last + 2 + i]`` with log-probs ``-0.5, -0.25``."""

    made: ClassVar[list[_LLM]] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        _LLM.made.append(self)

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        if not isinstance(params, list):  # vLLM takes one for every request, or one each
            params = [params] * len(requests)
        self.calls.append(([r["prompt_token_ids"] for r in requests], params))
        outputs = []
        for r, p in zip(requests, params):
            last = r["prompt_token_ids"][-1]
            completions = []
            for i in range(p.kwargs["n"]):
                ids = [last + 1 + i, last + 2 + i]
                logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, (-0.5, -0.25))]
                completions.append(SimpleNamespace(index=i, token_ids=ids, logprobs=logprobs))
            outputs.append(SimpleNamespace(outputs=completions[::-1]))  # any order: sorted back
        return outputs

    def collective_rpc(self, name, kwargs):
        self.loaded.append((name, [n for n, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        pass

    @property
    def llm_engine(self):
        return SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = ModuleType("vllm")
    vllm.LLM = _LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)  # type: ignore[attr-defined]
    state = ModuleType("vllm.distributed.parallel_state")
    state._WORLD = None  # type: ignore[attr-defined]
    state.destroy_distributed_environment = lambda: None  # type: ignore[attr-defined]
    distributed = ModuleType("vllm.distributed")
    distributed.parallel_state = state  # type: ignore[attr-defined]
    for name, module in [
        ("vllm", vllm),
        ("vllm.distributed", distributed),
        ("vllm.distributed.parallel_state", state),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda where: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine sets it: restored
    _LLM.made.clear()
    return _LLM.made


def test_colocated_engine_samples_through_the_shared_base(fake_vllm, tiny_model, tokenizer):
    engine = VLLMEngine(max_new_tokens=4, temperature=0.7, top_k=3, seed=5, sleep_mode=False)
    eos = tokenizer.eos_token_id
    engine.bind(tiny_model, tokenizer.pad_token_id, eos, max_length=40)
    (llm,) = fake_vllm
    # Started for this model: the run's context limit and the sampler's seed reach vLLM, and
    # the start's check is one greedy request (no seed drawn for it).
    assert llm.kwargs["max_model_len"] == 40 and llm.kwargs["seed"] == 5
    assert llm.calls[0][1][0].kwargs["temperature"] == 0.0 and len(llm.calls) == 1
    rollout = engine.generate([[10, 11, 12], [20]], 2)
    assert len(llm.loaded) == 1 and engine.syncs == 1  # the policy loaded before sampling
    assert llm.loaded[0][0] == "reload_weights"
    prompts, params = llm.calls[1]
    assert prompts == [[10, 11, 12], [20]]
    args = [p.kwargs for p in params]
    assert {(a["n"], a["temperature"], a["top_k"], a["top_p"], a["max_tokens"]) for a in args} == {
        (2, 0.7, 3, 1.0, 4)
    }
    assert args[0]["stop_token_ids"] == [eos] and args[0]["logprobs"] == 0
    assert args[0]["seed"] != args[1]["seed"]
    assert rollout.completion_ids[:, :2].tolist() == [[13, 14], [14, 15], [21, 22], [22, 23]]
    assert torch.allclose(rollout.sampler_logps[:, :2], torch.tensor([[-0.5, -0.25]] * 4))
    # Same weights: no second load; the same prompt again at this version gets a new seed.
    engine.generate([[10, 11, 12]], 2)
    assert len(llm.loaded) == 1
    assert llm.calls[2][1][0].kwargs["seed"] != args[0]["seed"]
    engine.close()
    assert engine.llm is None


def test_without_importance_sampling_no_sampler_logps(fake_vllm, tiny_model, tokenizer):
    engine = VLLMEngine(max_new_tokens=4, importance_sampling=False, sleep_mode=False)
    engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert engine.seed == torch.initial_seed() % (1 << 31)  # the run's seed by default
    rollout = engine.generate([[10, 11]], 2)
    assert rollout.sampler_logps is None and engine.sampler.importance_sampling_cap is None
    engine.close()
