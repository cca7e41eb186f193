"""Host memory: the available-memory reading, the activation estimate, checkpointing's auto
decision (observed on the model's own layers)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.train_utils import quiet_config, train
from transformers import LlamaConfig, LlamaForCausalLM

from grimoire import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.model import host_memory as hm
from grimoire.model.tiny import build_model, build_tokenizer
from grimoire.tools.memory import Setup, estimate, shape_from_config

GIB = 1 << 30


def _fake_root(tmp_path, meminfo_kb=None, **cgroup):
    if meminfo_kb is not None:
        (tmp_path / "proc").mkdir(parents=True)
        (tmp_path / "proc/meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {meminfo_kb} kB\n"
        )
    for name, value in cgroup.items():
        path = tmp_path / "sys/fs/cgroup" / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return tmp_path


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    assert hm.available_memory(_fake_root(tmp_path / "none")) is None
    assert hm.available_memory(_fake_root(tmp_path / "plain", 2048)) == 2048 * 1024
    # cgroup v2: 1 GiB limit, 256 MiB used -> 768 MiB of room, below MemAvailable's 8 GiB.
    root = _fake_root(
        tmp_path / "v2", 8 * 1024 * 1024, **{"memory.max": GIB, "memory.current": 256 << 20}
    )
    assert hm.available_memory(root) == 768 << 20
    root = _fake_root(tmp_path / "nolimit", 4096, **{"memory.max": "max", "memory.current": 5})
    assert hm.available_memory(root) == 4096 * 1024
    v1 = {"memory__memory.limit_in_bytes": 3 * GIB, "memory__memory.usage_in_bytes": GIB}
    assert hm.available_memory(_fake_root(tmp_path / "v1", 8 * 1024 * 1024, **v1)) == 2 * GIB
    unlimited_v1 = {
        "memory__memory.limit_in_bytes": 2**63 - 4096,
        "memory__memory.usage_in_bytes": 1,
    }
    root = _fake_root(tmp_path / "v1max", 1000, **unlimited_v1)
    assert hm.available_memory(root) == 1000 * 1024


def _llama(**kw):
    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=160, num_hidden_layers=3)
    cfg.update(num_attention_heads=4, num_key_value_heads=2, **kw)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def test_activation_estimate_by_hand():
    # 3 layers, H=64, 4 heads of 16 (Q=64), 2 kv heads (K=32), I=160, fp32 (model/activations.py):
    # a layer keeps 2 norms x (fp32 input 4H + 1/rms 4 + x*rsqrt 4H + output 4H) = 1544,
    # attention 4 (2Q + 2K) + 4 heads = 784, the MLP 3 x 4I + the product 4I = 2560: 4888.
    # Outside: ids 8, cos/sin 2 x 16 x 4, final norm 4H + 4 + 4H, its output for the head 4H: 908;
    # backward's hidden-state gradients 2 x 4H = 512.
    model = _llama()
    assert hm.activation_bytes_per_token(model) == 3 * 4888 + 908 + 512
    # Checkpointed: each layer's input (4H) and the one layer being recomputed.
    assert hm.activation_bytes_per_token(model, checkpointing=True) == 3 * 256 + 4888 + 908 + 512
    assert hm.activation_bytes_per_token(torch.nn.Linear(2, 2)) is None  # no config: unknown


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_host_decision_and_estimate_memory_count_the_same_activations(
    arch, checkpointing, precision
):
    """One activation model: the bytes per token the checkpointing decision weighs are the
    bytes per token of ``estimate-memory``'s activations part for the same model and precision
    on a CPU (tied and untied heads, grouped-query heads, Gemma-2's own head size)."""
    model = build_model(arch, vocab_size=96, hidden_size=64, num_layers=3)
    config = _config(mixed_precision=precision, gradient_checkpointing=checkpointing)
    tokens = 512
    setup = Setup(
        mixed_precision=precision, checkpointing=checkpointing, tokens=tokens, device="cpu"
    )
    from_cli = estimate(shape_from_config(model.config), setup).part("activations").device
    host = hm.activation_bytes_per_token(model, config, checkpointing)
    assert host is not None and host * tokens == from_cli


@pytest.mark.parametrize("bf16", [False, True])
def test_activation_estimate_bounds_what_autograd_saves(bf16):
    """Observed: the bytes autograd saves for backward in a decoder forward (hooks on every saved
    tensor, each storage counted once, parameters excluded) stay below the estimate, and not
    far below it (the estimate is meant as a generous bound, not a guess off by 10x)."""
    model = _llama(hidden_size=128, intermediate_size=320, vocab_size=128).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = 256
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
    ):
        model.model(ids, use_cache=False)
    per_token = sum(saved.values()) / tokens
    estimate = hm.activation_bytes_per_token(model)
    assert 0.5 * estimate <= per_token <= estimate, (per_token, estimate)


def _config(**kw):
    return TrainingConfig(output_dir="unused", batch_size=2, max_length=100, **kw)


def test_checkpointing_decision():
    model = _llama()
    per_token = hm.activation_bytes_per_token(model, _config())
    # No budget and no method to ask: 2 sequences x batch_size 2 x max_length 100 positions.
    need = per_token * 400
    exact = int(need / hm.AUTO_CHECKPOINTING_MEMORY_SHARE)
    assert hm.checkpointing_decision(model, _config(), "cpu", available=exact)[0] is False
    on, why = hm.checkpointing_decision(model, _config(), "cpu", available=exact - 1)
    assert on and "set gradient_checkpointing=false" in why
    # Two processes on the host need twice the room.
    assert hm.checkpointing_decision(model, _config(), "cpu", 2, available=exact)[0] is True
    # A token budget bounds the micro-batch instead.
    budget = _config(max_tokens_per_device=40)
    assert hm.checkpointing_decision(model, budget, "cpu", available=exact // 10)[0] is False
    assert hm.checkpointing_decision(model, _config(), "cuda", available=10**15)[0] is True
    for forced in (True, False):
        cfg = _config(gradient_checkpointing=forced)
        assert hm.checkpointing_decision(model, cfg, "cpu", available=1)[0] is forced
        assert hm.checkpointing_decision(model, cfg, "cuda")[0] is forced
    assert hm.checkpointing_decision(torch.nn.Linear(2, 2), _config(), "cpu")[0] is True
    with pytest.raises(ConfigError, match="gradient_checkpointing must be true, false or 'auto'"):
        _config(gradient_checkpointing="yes")


def test_micro_batch_bound_asks_the_method():
    """Without a budget, a row costs what the method says a row costs at max_length (the
    TokenBudget rule): one sequence for SFT, two for a pair, G completions for an online
    prompt; with a budget, the budget."""
    from grimoire.losses import DPOLoss

    cfg = _config()  # batch_size 2, max_length 100
    sft = [{"input_ids": [1, 2], "labels": [1, 2]}]
    pairs = [{"chosen_input_ids": [1], "rejected_input_ids": [1, 2]}]
    assert hm.micro_batch_tokens(cfg, SFTLoss(), sft) == 2 * 100
    assert hm.micro_batch_tokens(cfg, DPOLoss(), pairs) == 2 * 2 * 100

    class Online:  # the online methods' rule: num_generations x (prompt + max_new_tokens)
        def budget_tokens(self, lengths, packed):
            return 4 * (lengths["prompt_"] + 8)

    prompts = [{"prompt_input_ids": [1, 2, 3]}]
    assert hm.micro_batch_tokens(cfg, Online(), prompts) == 2 * 4 * (100 + 8)
    assert hm.micro_batch_tokens(cfg) == 2 * 2 * 100  # nothing to ask: two sequences a row
    assert hm.micro_batch_tokens(cfg, SFTLoss(), iter(sft)) == 2 * 2 * 100  # a stream
    assert hm.micro_batch_tokens(_config(max_tokens_per_device=64), DPOLoss(), pairs) == 64


def _layer_calls(tmp_path, monkeypatch, available, **overrides):
    """Forward calls of the first decoder layer's MLP over a 2-step run: observed on the model
    itself (checkpointing re-runs the layer in backward; a pre-hook, since the recompute stops
    early, once it has what backward needs, before any forward hook would fire)."""
    monkeypatch.setattr(hm, "available_memory", lambda: available)
    model = _llama(vocab_size=128)
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    rows = [{"input_ids": [1, 5, 6, 7, 8, 9], "labels": [-100, 5, 6, 7, 8, 9]}] * 4
    config = quiet_config(tmp_path, max_steps=2, batch_size=2, **overrides)
    trainer = train(model, build_tokenizer(), rows, SFTLoss(), config)
    return len(calls), trainer


def test_auto_checkpointing_is_what_the_model_runs(tmp_path, monkeypatch):
    auto = dict(gradient_checkpointing="auto", max_length=16)
    plenty, trainer = _layer_calls(tmp_path / "a", monkeypatch, 64 * GIB, **auto)
    assert plenty == 2  # one forward per step, no recompute
    summary = json.loads((tmp_path / "a" / "run_summary.json").read_text())
    assert summary["activation_checkpointing"] is False and trainer.checkpointing[0] is False
    assert _layer_calls(tmp_path / "b", monkeypatch, 1024, **auto)[0] == 4  # + recompute
    assert _layer_calls(tmp_path / "c", monkeypatch, 64 * GIB, gradient_checkpointing=True)[0] == 4
