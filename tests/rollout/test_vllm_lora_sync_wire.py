"""``lora_sync: adapter`` without vLLM: the vLLM server client against the real HTTP handler
with a stand-in sampler. The base weights (unmerged) go once; after that only the adapter's
tensors (peft's names), each version with a new id; a server without LoRA is refused before
training; the bytes logged are the bytes sent."""

from __future__ import annotations

import threading
from http.server import HTTPServer

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from tests.rollout.test_vllm_server_wire import StandIn

from grimoire.errors import ConfigError
from grimoire.rollout.engines.vllm_common import lora_args
from grimoire.rollout.engines.vllm_server import VLLMServerEngine, read_frames
from grimoire.rollout.engines.vllm_weights import checkpoint_name, merged_bytes
from grimoire.tools.vllm_serve import handler


class LoRAStandIn(StandIn):
    def __init__(self, config, max_lora_rank):
        super().__init__(config)
        self.max_lora_rank, self.adapters = max_lora_rank, []

    def info(self):
        return {**super().info(), "max_lora_rank": self.max_lora_rank}

    def load_adapter(self, adapter_id, config, stream):
        self.adapters.append((adapter_id, config, dict(read_frames(stream))))
        return {"ok": True}


def _serve(stand_in):
    server = HTTPServer(("127.0.0.1", 0), handler(stand_in))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _lora(model):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(model, config)
    for name, p in policy.named_parameters():  # B != 0: a merge would change the base weights
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return policy


@pytest.mark.parametrize("rank", [0, 8])
def test_adapter_sync_sends_base_once_then_adapter_only_or_refuses_a_server_without_lora(
    tiny_model, tokenizer, rank
):
    policy = _lora(tiny_model)
    stand_in = LoRAStandIn(tiny_model.config, rank)
    server, url = _serve(stand_in)
    try:
        engine = VLLMServerEngine(max_new_tokens=4, url=url)
        if rank == 0:
            with pytest.raises(ConfigError, match="--max-lora-rank >= 4"):
                engine.bind(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
            return
        engine.bind(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
        engine.generate([[10, 11, 12]], 2)
        # The base, unmerged, under the plain model's names: equal to the base layers' weights.
        assert len(stand_in.pushed) == 1 and engine.base_loads == 1
        base = {checkpoint_name(n): p for n, p in policy.named_parameters() if ".lora_" not in n}
        sent = dict(stand_in.pushed[0])
        assert set(base) <= set(sent)
        assert all(torch.equal(sent[k], v.detach()) for k, v in base.items())
        ((first_id, config, tensors),) = stand_in.adapters
        want = get_peft_model_state_dict(policy)
        assert set(tensors) == set(want) and all(torch.equal(tensors[k], want[k]) for k in want)
        assert config["r"] == 4 and config["lora_alpha"] == 8
        adapter_bytes = sum(t.numel() * t.element_size() for t in want.values())
        base_bytes = sum(t.numel() * t.element_size() for _, t in stand_in.pushed[0])
        assert engine.sync_metrics() == {
            "weight_sync/bytes": float(base_bytes + adapter_bytes),
            "weight_sync/merged_bytes": float(merged_bytes(policy)),
        }
        # An optimizer step: the adapter alone, under a new id; the base is not sent again.
        optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
        ids = torch.tensor([[1, 2, 3]])
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        engine.generate([[10, 11, 12]], 2)
        assert len(stand_in.pushed) == 1 and len(stand_in.adapters) == 2
        second_id, _, tensors = stand_in.adapters[1]
        want = get_peft_model_state_dict(policy)
        assert second_id == first_id + 1
        assert all(torch.equal(tensors[k], want[k]) for k in want)
        assert engine.sync_metrics()["weight_sync/bytes"] == adapter_bytes
    finally:
        server.shutdown()
        server.server_close()


def test_vllm_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    assert lora_args(4)["max_lora_rank"] == 8
    assert lora_args(16)["max_lora_rank"] == 16
    assert lora_args(300)["max_lora_rank"] == 320
    with pytest.raises(ConfigError, match="up to 512"):
        lora_args(1024)


@pytest.mark.parametrize(
    "extra, message",
    [(dict(use_dora=True), "no DoRA adapters"), (dict(modules_to_save=["lm_head"]), "merged")],
    ids=["dora", "modules_to_save"],
)
def test_adapter_sync_refuses_what_an_adapter_alone_cannot_carry_at_bind(
    tiny_model, tokenizer, extra, message
):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
    policy = get_peft_model(tiny_model, config)
    stand_in = LoRAStandIn(tiny_model.config, 8)
    server, url = _serve(stand_in)
    try:
        engine = VLLMServerEngine(max_new_tokens=4, url=url)
        with pytest.raises(ConfigError, match=message):
            engine.bind(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
        assert stand_in.pushed == [] and stand_in.adapters == []  # nothing was sent
        merged = VLLMServerEngine(max_new_tokens=4, url=url, lora_sync="merged")
        if "modules_to_save" in extra:  # the merged sync carries them
            merged.bind(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
            merged.generate([[10, 11]], 1)
            assert len(stand_in.pushed) == 1 and stand_in.adapters == []
    finally:
        server.shutdown()
        server.server_close()
