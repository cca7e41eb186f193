"""Choosing the rollout engine (``engine=`` / ``loss.args.engine``), vLLM's absence as a clear
error before training, and the truncated importance-sampling correction's math. Runs without
vLLM (the vLLM runs themselves are in tests/vllm_backend)."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import replace

import pytest
import torch

import grimoire.rollout.engines.vllm_engine as vllm_engine
from grimoire.cli.schema import check_config
from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.online_dpo import OnlineDPOMethod
from grimoire.losses.raft import RAFTMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.losses.sampler_functional import truncated_importance_weights
from grimoire.rollout.engines.backends import build_engine, engine_problems
from grimoire.rollout.engines.base import RolloutEngine, SamplerConfig
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.vllm_server import VLLMServerEngine
from grimoire.rollout.stage import SamplingConfig

INSTALL = "pip install 'grimoire[vllm]'"


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM absent, wherever the test runs (its own venv included)."""
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)


@pytest.mark.parametrize("method", [GRPOMethod, RLOOMethod, OnlineDPOMethod, RAFTMethod])
@pytest.mark.parametrize("engine", ["vllm", {"type": "vllm", "args": {"max_model_len": 64}}])
def test_vllm_without_the_package_is_a_config_error_naming_the_install(no_vllm, method, engine):
    with pytest.raises(ConfigError, match=re.escape(INSTALL)):
        method(["char_match"], engine=engine)


def _raw(engine):
    return {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"jsonl": "grimoire://assets/reverse_train.jsonl"},
        "loss": {"type": "grpo", "args": {"reward_funcs": ["char_match"], "engine": engine}},
    }


def test_yaml_engine_vllm_without_the_package_fails_the_config_check(no_vllm):
    # check_config runs first in `grimoire train` / `validate`: before any model is loaded.
    with pytest.raises(ConfigError) as info:
        check_config(_raw("vllm"))
    assert info.value.problems == [
        f"loss.args.engine: the vllm package is not installed; {vllm_engine.INSTALL_HINT}"
    ]


def test_yaml_engine_problems_are_listed_together():
    problems = engine_problems(
        {"type": "vllm", "args": {"temperature": 0.5, "gpu_memory_utilisation": 0.3}},
        "loss.args.engine",
    )
    assert problems[0].startswith("loss.args.engine.args.temperature: a sampling setting")
    assert problems[1].startswith("loss.args.engine.args.gpu_memory_utilisation: unknown vllm")
    assert 'did you mean "gpu_memory_utilization"' in problems[1]
    assert engine_problems("vlm") == [
        "engine: unknown engine 'vlm' (did you mean \"vllm\"?); known: hf, vllm, vllm-server"
    ]
    assert engine_problems({"kind": "vllm"})[0].startswith("engine: expected a name or")
    assert engine_problems(3)[0].startswith("engine: expected an engine name")
    assert check_config(_raw("hf")).output_dir  # hf is always there


def test_names_and_mappings_get_the_methods_sampling_settings():
    sampling = SamplerConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12)
    for spec in (None, "hf", {"type": "hf", "args": {"prefill_once": False}}):
        engine = build_engine(spec, sampling)
        assert isinstance(engine, HFGenerateEngine)
        # Samples from the policy itself: no importance-sampling cap, no seed of its own.
        assert engine.sampler == sampling
    assert (
        build_engine({"type": "hf", "args": {"prefill_once": False}}, sampling).prefill_once
        is False
    )
    mine = HFGenerateEngine(max_new_tokens=3, temperature=0.5, top_k=2)
    method = GRPOMethod(["char_match"], engine=mine, max_new_tokens=99, top_k=7)
    assert method.engine is mine and method.max_new_tokens == 3 and method.temperature == 0.5
    # The method's sampling is the engine's, every setting of it (top_k too), plus G.
    assert method.sampling == SamplingConfig.of(mine.sampler, 8)
    assert method.sampling.top_k == 2 and method.sampling.num_generations == 8


def test_sampler_settings_are_checked_once_with_every_problem_listed():
    with pytest.raises(ValueError) as info:
        SamplerConfig(max_new_tokens=0, temperature=0.0, top_p=1.5, top_k=-1, seed=1.5)
    message = str(info.value)
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
        assert f"{name} must be" in message
    # Every engine and every method goes through the one check.
    for build in (
        lambda: HFGenerateEngine(top_k=-1),
        lambda: vllm_engine.VLLMEngine(top_k=-1),
        lambda: VLLMServerEngine(top_k=-1),
        lambda: GRPOMethod(["char_match"], top_k=-1),
    ):
        with pytest.raises(ValueError, match=r"sampler settings: top_k must be an int >= 0"):
            build()
    with pytest.raises(ValueError, match="importance_sampling_cap must be >= 1"):
        VLLMServerEngine(importance_sampling_cap=0.5)
    assert VLLMServerEngine(importance_sampling=False).sampler.importance_sampling_cap is None
    server = VLLMServerEngine(seed=3, importance_sampling_cap=3.0, top_p=0.5)
    assert (server.sampler.seed, server.sampler.importance_sampling_cap) == (3, 3.0)
    assert server.sampler.top_p == 0.5


def test_engine_signatures_list_every_argument_they_pass_up():
    """The YAML check of ``engine.args`` reads the engines' signatures: a backend that passes
    the sampler settings up as ``**settings`` still lists them, its base's arguments too."""
    server = inspect.signature(VLLMServerEngine.__init__).parameters
    assert {"url", "timeout", "api_key", "seed", "importance_sampling_cap"} <= set(server)
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "generation_batch_size"} <= set(
        server
    )
    assert not any(p.kind is p.VAR_KEYWORD for p in server.values())
    vllm = inspect.signature(vllm_engine.VLLMEngine.__init__).parameters
    assert {"gpu_memory_utilization", "seed", "importance_sampling", "top_k"} <= set(vllm)
    hf = inspect.signature(HFGenerateEngine.__init__).parameters
    assert {"prefill_once", "static_cache", "top_p"} <= set(hf) and "seed" not in hf
    assert engine_problems({"type": "vllm-server", "args": {"seed": 1, "api_key": "k"}}) == []
    assert engine_problems({"type": "vllm-server", "args": {"lora_sync": "merged"}}) == []
    assert engine_problems({"type": "vllm-server", "args": {"lora_sync": "merge"}}) == [
        "engine.args.lora_sync: 'merge'; expected 'adapter' or 'merged'"
    ]
    assert engine_problems({"type": "hf", "args": {"seed": 1}})[0].startswith(
        "engine.args.seed: unknown hf engine argument"
    )


def test_an_engine_without_sample_cannot_be_built():
    class NoSampler(RolloutEngine):
        pass

    with pytest.raises(TypeError, match="_sample"):
        NoSampler()  # type: ignore[abstract]


def test_truncated_importance_weights_against_a_naive_loop():
    torch.manual_seed(0)
    old = -torch.rand(3, 5) * 3
    sampler = old + torch.randn(3, 5)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    weights, metrics = truncated_importance_weights(old, sampler, mask, cap=2.0)
    expected, capped, gaps = torch.ones(3, 5), [], []
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                ratio = math.exp(float(old[i, t] - sampler[i, t]))
                expected[i, t] = min(ratio, 2.0)
                capped.append(ratio > 2.0)
                gaps.append(abs(float(old[i, t] - sampler[i, t])))
    assert torch.allclose(weights, expected)
    assert not weights.requires_grad
    n = int(mask.sum())
    assert math.isclose(
        float(metrics["sampling/importance_sampling_ratio/mean"]),
        float(expected[mask.bool()].sum()) / n,
        rel_tol=1e-6,
    )
    assert math.isclose(
        float(metrics["sampling/importance_sampling_ratio/clipped_frac"]),
        sum(capped) / n,
        rel_tol=1e-6,
    )
    assert math.isclose(
        float(metrics["sampling/sampling_logp_difference/mean"]), sum(gaps) / n, rel_tol=1e-6
    )


class _Sampler(HFGenerateEngine):
    """An HF engine that says it is a separate sampler (as vLLM does), for the loss math."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sampler = replace(self.sampler, importance_sampling_cap=2.0)


def _batch(sampler_shift: float):
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.long)
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "sampler_logps": torch.full((4, 3), sampler_shift) * completion_mask,
    }


@pytest.mark.parametrize("method_cls", [GRPOMethod, RLOOMethod])
def test_policy_gradient_losses_weight_tokens_by_the_truncated_ratio(tiny_model, method_cls):
    kwargs = {"beta": 0.0} if method_cls is RLOOMethod else {}
    plain = method_cls(["char_match"], num_generations=2, **kwargs)
    corrected = method_cls(["char_match"], num_generations=2, engine=_Sampler(), **kwargs)
    batch = _batch(-6.0)  # below the policy's log-probs: ratios > 1, some capped
    loss_plain, m_plain = plain.compute_loss(tiny_model, batch)
    loss, m = corrected.compute_loss(tiny_model, batch)
    assert "sampling/importance_sampling_ratio/mean" not in m_plain  # HF: bit-identical
    logps, _ = plain.policy_logps(tiny_model, batch)
    weights, _ = truncated_importance_weights(
        logps.detach(), batch["sampler_logps"], batch["completion_mask"], 2.0
    )
    assert 1.0 < float(m["sampling/importance_sampling_ratio/mean"]) <= 2.0
    assert not torch.allclose(loss, loss_plain)
    if method_cls is GRPOMethod:  # dapo: token mean of -A * w (ratio 1 at one update)
        mask = batch["completion_mask"]
        expected = -(batch["advantages"][:, None] * weights * mask).sum() / mask.sum()
    else:  # RLOO: -mean_i A_i sum_t w_t logp_t
        expected = -(batch["advantages"] * (logps * weights).sum(-1)).mean()
    assert torch.allclose(loss, expected, atol=1e-6)
