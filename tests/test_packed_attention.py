"""grimoire_packed_sdpa: a packed row attends per sample, everything else is transformers' sdpa.

Observed from outside: per-token log-probs and parameter gradients against the same packed row
through plain sdpa and against each sample run alone; the query lengths torch's sdpa kernel is
called with (the packed row's L never reaches it); padded batches and KV-cache generation give
bitwise the same outputs as sdpa.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tests.helpers.train_utils import quiet_config

from grimoire.forward.logprobs import compute_token_logps
from grimoire.model.packed_attention import (
    NAME,
    PACKED_CAUSAL,
    enable_packed_attention,
    packed_sdpa_attention_forward,
    unsupported_reason,
)
from grimoire.model.prepare import enable_checkpointing
from grimoire.model.tiny import build_model
from grimoire.training.setup import prepare_model

# A boundary mid-row, a length-1 sample, and samples of several lengths.
LENGTHS = [5, 1, 9, 3]


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Query lengths and masks of every torch sdpa call (transformers calls it by attribute)."""
    calls: list[tuple[int, bool, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append((query.shape[-2], attn_mask is not None, is_causal))
        return real(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _samples(lengths: list[int], vocab: int = 64, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def _packed(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    return ids, pos


def _logps_and_grads(model, ids, pos) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token log-probs of the row and the gradients of a weighted sum of them."""
    model.zero_grad()
    out = compute_token_logps(model, ids, ids.clone(), position_ids=pos, fused=False)
    weights = torch.linspace(0.5, 1.5, out.logps.numel()).view_as(out.logps)
    (out.logps * weights * out.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logps.detach() * out.mask, grads


def _two_models(arch: str):
    plain = build_model(arch, vocab_size=64)
    packed = copy.deepcopy(plain)
    assert enable_packed_attention(packed)
    assert packed.config._attn_implementation == NAME
    assert plain.config._attn_implementation == "sdpa"
    return plain, packed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_row_equals_sdpa_and_samples_alone(arch, sdpa_calls):
    plain, packed = _two_models(arch)
    plain.train(), packed.train()
    enable_checkpointing(packed)  # the recompute runs the attention a second time
    samples = _samples(LENGTHS)
    ids, pos = _packed(samples)

    want, want_grads = _logps_and_grads(plain, ids, pos)
    assert {c[0] for c in sdpa_calls} == {sum(LENGTHS)}, "plain sdpa: one dense L x L call"
    assert all(c[1] for c in sdpa_calls), "plain sdpa gets the block-diagonal mask"
    sdpa_calls.clear()

    got, got_grads = _logps_and_grads(packed, ids, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Only within-sample blocks were computed: forward + checkpoint recompute, per layer, per
    # sample, causal and unmasked (a length-1 sample needs no causal flag).
    layers = plain.config.num_hidden_layers
    assert sorted(c[0] for c in sdpa_calls) == sorted(LENGTHS * layers * 2)
    assert all(not masked and (causal or n == 1) for n, masked, causal in sdpa_calls)

    # (b) each sample alone: the packed row's log-probs of sample i are its own.
    start = 0
    for sample in samples:
        alone, _ = _logps_and_grads(plain, sample[None], torch.arange(len(sample))[None])
        torch.testing.assert_close(got[:, start : start + len(sample)], alone, atol=1e-5, rtol=0)
        start += len(sample)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_row_of_one_sample_is_plain_causal(arch, sdpa_calls):
    plain, packed = _two_models(arch)
    ids, pos = _packed(_samples([11]))
    want, want_grads = _logps_and_grads(plain, ids, pos)
    sdpa_calls.clear()
    got, got_grads = _logps_and_grads(packed, ids, pos)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert sdpa_calls and all(c == (11, False, True) for c in sdpa_calls)


def test_padded_batch_is_sdpa_bitwise(sdpa_calls):
    plain, packed = _two_models("llama")
    plain.eval(), packed.eval()
    ids = torch.randint(3, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
        n_plain = len(sdpa_calls)
        got = packed(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)
    assert sdpa_calls[n_plain:] == sdpa_calls[:n_plain]
    assert all(masked for _, masked, _ in sdpa_calls)


def test_generation_with_kv_cache_is_sdpa_bitwise():
    plain, packed = _two_models("qwen2")
    plain.eval(), packed.eval()
    prompts = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0  # left-padded prompt: generate's position_ids restart inside it
    outs = []
    for model in (plain, packed):
        outs.append(
            model.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=6,
                do_sample=False,
                use_cache=True,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        )
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    for got, want in zip(outs[1].scores, outs[0].scores, strict=True):
        assert torch.equal(got, want)


def test_unsupported_models_keep_their_attention(caplog):
    gemma = build_model("gemma2", vocab_size=64)
    with caplog.at_level(logging.INFO, logger="grimoire.model.packed_attention"):
        assert not enable_packed_attention(gemma)
        assert not enable_packed_attention(build_model("gemma2", vocab_size=64, seed=1))
    assert gemma.config._attn_implementation == "eager"
    logged = [r.getMessage() for r in caplog.records if "gemma2" in r.getMessage()]
    assert len(logged) == 1, "the reason is logged once"

    sliding = build_model("qwen2", vocab_size=64, use_sliding_window=True, max_window_layers=0)
    assert "sliding" in unsupported_reason(sliding)
    llama = build_model("llama", vocab_size=64)
    assert "torch_compile" in unsupported_reason(llama, torch_compile=True)
    llama.set_attn_implementation("eager")
    assert "'eager'" in unsupported_reason(llama)


def test_marker_without_position_ids_fails_loudly():
    model = build_model("llama", vocab_size=64)
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 16)
    kv = torch.zeros(1, 2, 5, 16)
    with pytest.raises(RuntimeError, match="position_ids"):
        packed_sdpa_attention_forward(attn, q, kv, kv, PACKED_CAUSAL)


UNIFORM = [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 8
#: One long row among short ones: a padded batch of 4 computes 4 x 40 positions for 49 tokens.
LONG_TAILED = [{"input_ids": [1] + [5] * n, "labels": [-100] + [5] * n} for n in (39, 2, 3, 1)] * 2


@pytest.mark.parametrize(
    "overrides,rows,selected",
    [
        ({"padding_free": True}, UNIFORM, True),
        ({"max_tokens_per_device": 64}, UNIFORM, True),
        ({}, LONG_TAILED, True),  # auto: padding adds >= 80% positions however rows are batched
        ({}, UNIFORM, False),  # auto: nothing to save, the padded path is cheaper
        ({"padding_free": False}, LONG_TAILED, False),
    ],
)
def test_the_trainer_selects_it_for_packed_runs(tmp_path, tokenizer, overrides, rows, selected):
    from grimoire import GrimoireTrainer
    from grimoire.losses import SFTLoss

    trainer = GrimoireTrainer(
        build_model("llama", vocab_size=64),
        tokenizer,
        quiet_config(tmp_path, batch_size=4, **overrides),
        SFTLoss(),
        rows,
    )
    assert trainer.packed is selected
    assert (trainer.unwrapped_model.config._attn_implementation == NAME) is selected


def test_auto_stays_padded_on_a_cuda_device_and_an_explicit_switch_still_packs(tmp_path):
    """The one GPU measurement had packing 6.6x slower than padded: auto does not pack on CUDA
    (device_type is what the trainer passes from its accelerator), padding_free=True does."""
    from grimoire.batching.loader import AUTO_PACKING_CUDA_NOTE, packing_decision
    from grimoire.losses import SFTLoss

    model = build_model("llama", vocab_size=64)
    auto = quiet_config(tmp_path, batch_size=4)
    assert packing_decision(SFTLoss(), auto, 0, None, model, LONG_TAILED, "cpu")[0] is True
    packed, why = packing_decision(SFTLoss(), auto, 0, None, model, LONG_TAILED, "cuda")
    assert (packed, why) == (False, AUTO_PACKING_CUDA_NOTE)
    forced = quiet_config(tmp_path, batch_size=4, padding_free=True)
    assert packing_decision(SFTLoss(), forced, 0, None, model, LONG_TAILED, "cuda")[0] is True


def test_padding_ratio_by_hand():
    from grimoire.batching.budget import padding_ratio

    # One batch of all 8 rows (however they are shuffled): 8 x 40 positions for 2 x 49 tokens.
    assert padding_ratio(LONG_TAILED, batch_size=8) == pytest.approx(320 / 98)
    assert padding_ratio(UNIFORM, batch_size=4) == 1.0
    pairs = [{"chosen_input_ids": [1] * 3, "rejected_input_ids": [1] * 1}] * 2
    assert padding_ratio(pairs, batch_size=2) == 1.0  # each column is padded on its own


def test_lora_model_is_switched_on_its_base(tmp_path):
    from peft import LoraConfig

    config = quiet_config(tmp_path, padding_free=True)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    model, _ = prepare_model(build_model("llama", vocab_size=64), lora, config, None, packed=True)
    assert model.get_base_model().config._attn_implementation == NAME
    ids, pos = _packed(_samples(LENGTHS))
    plain = copy.deepcopy(model)
    plain.get_base_model().set_attn_implementation("sdpa")
    got = compute_token_logps(model, ids, ids, position_ids=pos, fused=False)
    want = compute_token_logps(plain, ids, ids, position_ids=pos, fused=False)
    torch.testing.assert_close(got.logps, want.logps, atol=1e-5, rtol=0)


def test_inference_mode_and_reused_position_ids():
    """The sample lengths are re-read when the position_ids tensor changes in place, and read
    without a cache for inference tensors (no version counter)."""
    plain, packed = _two_models("llama")
    ids, pos = _packed(_samples(LENGTHS))
    with torch.inference_mode():
        want = plain(input_ids=ids, position_ids=pos.clone(), use_cache=False).logits
        got = packed(input_ids=ids, position_ids=pos.clone(), use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        packed(input_ids=ids, position_ids=pos, use_cache=False)
        pos[0, 3:] = torch.arange(pos.shape[1] - 3)  # now samples of 3 and 15 tokens
        want = plain(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = packed(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_per_sample_calls_exclude_cudnn_attention_on_cuda_only():
    """cuDNN attention plans per sequence length; per-sample calls on CUDA keep to flash /
    memory-efficient / math. The CPU path is untouched (no context at all)."""
    import contextlib

    from grimoire.model.packed_attention import _per_sample_backends

    assert isinstance(_per_sample_backends(torch.device("cpu")), contextlib.nullcontext)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with _per_sample_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
