"""Varlen attention for packed rows, checked on a CPU.

``torch.nn.attention.varlen.varlen_attn`` runs on CUDA only (on this CPU build it raises
NotImplementedError: ``aten::_flash_attention_forward`` has no CPU kernel), so its numerics
cannot be run here. What is checked instead:

- the route a CUDA device gets, for every combination of what is installed (availability
  monkeypatched), and that the choice is logged once;
- ``cu_seqlens`` / ``max_seqlen`` come from the collator's host-side lengths, with no device
  read, and cover the row's end padding;
- the wrapper's arguments (layout transposition, int32 offsets, the causal window as the tuple
  ``(-1, 0)`` that varlen_attn needs, GQA, scale, autocast dtype) through a stand-in for
  ``varlen_attn`` (and for flash-attn's ``flash_attn_varlen_func``) that runs causal sdpa per
  segment: the model's log-probs and gradients through the varlen route equal those of the
  per-sample route and of padded rows; the step stays at one read;
- ``padding_free`` auto on a CUDA device packs only when packed rows would take a varlen kernel.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from tests.helpers.syncs import HostReads, step_reads
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.batching.loader import AUTO_PACKING_CUDA_NOTE, packing_decision
from grimoire.collate.packing import pack_samples
from grimoire.collate.sft import SFTCollator
from grimoire.contract.layout import LAYOUT_KEY, Packed
from grimoire.forward.attention_hints import RowsHint, attention_hint, rows_hint
from grimoire.forward.batch import sample_token_logps
from grimoire.losses import SFTLoss
from grimoire.losses.preference import policy_compute
from grimoire.model import packed_attention as pa
from grimoire.model import varlen_attention as va
from grimoire.model.packed_attention import enable_packed_attention
from grimoire.model.tiny import build_model, build_tokenizer
from grimoire.training import setup

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 0
LENS = (5, 1, 9, 3, 12)
KERNELS = va.Kernels(torch_varlen=True, flash_attn=True, capability=(9, 0))


def rows(lens=LENS) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in lens:
        ids = torch.randint(3, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


# --------------------------------------------------------------------------- the route


@pytest.mark.parametrize(
    "device,dtype,head_dim,dropout,kernels,route",
    [
        ("cuda", torch.bfloat16, 64, 0.0, KERNELS, "varlen"),
        ("cuda", torch.float16, 128, 0.0, KERNELS, "varlen"),
        ("cuda", torch.bfloat16, 64, 0.0, va.Kernels(False, True, (8, 0)), "flash_attn"),
        ("cuda", torch.bfloat16, 64, 0.0, va.Kernels(False, False, (9, 0)), "per_sample"),
        ("cuda", torch.float32, 64, 0.0, KERNELS, "per_sample"),  # flash takes fp16/bf16 only
        ("cuda", torch.bfloat16, 64, 0.1, KERNELS, "per_sample"),  # no dropout in the kernels
        ("cuda", torch.bfloat16, 64, 0.0, va.Kernels(True, True, (7, 5)), "per_sample"),
        ("cuda", torch.bfloat16, 512, 0.0, KERNELS, "per_sample"),
        ("cpu", torch.bfloat16, 64, 0.0, KERNELS, "per_sample"),
    ],
)
def test_the_route_for_each_device_and_kernel(device, dtype, head_dim, dropout, kernels, route):
    got, reason = va.choose_route(device, dtype, head_dim, dropout, kernels)
    assert got == route and reason


def test_the_route_is_logged_once(caplog):
    query = torch.zeros(1, 4, 3, 16)
    va._logged.clear()
    with caplog.at_level(logging.INFO, logger="grimoire.model.varlen_attention"):
        for _ in range(3):
            assert va.route_for(query, 0.0)[0] == "per_sample"
    lines = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert lines == [
        "packed attention: per_sample (varlen kernels run on CUDA only; causal sdpa "
        "per sample on cpu)"
    ]


def test_varlen_attn_is_cuda_only_here():
    """Why the numerics below use a stand-in: the real function has no CPU kernel."""
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(6, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(-1, 0))


# --------------------------------------------------------------------------- cu_seqlens


def test_cu_seqlens_come_from_host_lengths_without_reads():
    batch = pack_samples(rows(), PAD, pad_to_multiple_of=8)  # 30 tokens + 2 of end padding
    model = build_model("llama", vocab_size=64)
    enable_packed_attention(model)
    with HostReads("cpu") as reads:
        mask = attention_hint(
            model, batch[LAYOUT_KEY], batch["input_ids"], None, batch["position_ids"]
        )
        hint = rows_hint(mask)
        cu = hint.cu_seqlens
    assert reads.count == 0
    assert mask.shape == (1, 1, 0, 0) and mask.dtype == torch.bool  # 4-D: passed through as-is
    assert hint.segments == (*LENS, 2) and hint.max_seqlen == max(LENS)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 15, 18, 30, 32]
    assert hint.cu_seqlens is cu  # built once, shared by every layer
    # No hint for another attention implementation, a padded batch with position_ids, or none.
    plain = build_model("llama", vocab_size=64)
    args = (batch["input_ids"], None, batch["position_ids"])
    assert attention_hint(plain, batch[LAYOUT_KEY], *args) is None
    assert attention_hint(model, None, *args) is None
    padded = SFTCollator(PAD)(rows())
    causal = rows_hint(attention_hint(model, padded[LAYOUT_KEY], padded["input_ids"], None, None))
    assert causal.kind == "causal"


# --------------------------------------------------------------------------- the wrapper


#: The stand-in reads its offsets with the unpatched method: its own read is not the step's.
_TOLIST = torch.Tensor.tolist


def _reference_varlen(calls, flash=False):
    """Causal sdpa per segment of ``cu_seqlens`` (a host read: the real kernel reads them on
    the device), in the kernels' ``[L, heads, head_dim]`` layout, recording what it was given."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append(dict(q=q, k=k, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, **kw))
        assert q.shape[1] != k.shape[1]  # the tiny model has GQA: 4 query heads, 2 kv heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scale = kw["softmax_scale"] if flash else kw["scale"]
        out = []
        bounds = _TOLIST(cu_q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale
            )
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    return attend


@pytest.fixture
def varlen_route(monkeypatch):
    """Packed rows take the ``varlen`` route, with a stand-in for varlen_attn."""
    calls: list[dict] = []
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", _reference_varlen(calls))
    monkeypatch.setattr(pa, "route_for", lambda query, dropout: ("varlen", "test"))
    return calls


def _logps_and_grads(model, batch, layout=True, bf16=False):
    model.zero_grad(set_to_none=True)
    compute = policy_compute(model, fused=True, chunk_size=7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = sample_token_logps(
            compute if layout else (lambda *a: compute(*a[:4])),
            batch["input_ids"],
            batch["labels"],
            batch[LAYOUT_KEY],
            batch.get("attention_mask"),
            batch.get("position_ids"),
        )
    weights = torch.linspace(0.5, 1.5, out.logps.shape[1])
    (out.logps * weights).sum().backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_varlen_route_equals_per_sample_and_padded(varlen_route):
    model = build_model("llama", vocab_size=64)
    enable_packed_attention(model)
    packed = pack_samples(rows(), PAD, pad_to_multiple_of=8)
    varlen, g_varlen = _logps_and_grads(model, packed)
    assert len(varlen_route) == model.config.num_hidden_layers  # ONE call per layer
    call = varlen_route[0]
    scaling = model.model.layers[0].self_attn.scaling
    assert call["window_size"] == (-1, 0) and isinstance(call["window_size"], tuple)
    assert call["enable_gqa"] is True and call["scale"] == scaling
    assert call["q"].shape == (32, 4, 16) and call["k"].shape == (32, 2, 16)
    assert call["cu_q"] is call["cu_k"] and call["cu_q"].dtype == torch.int32
    assert call["cu_q"].tolist() == [0, 5, 6, 15, 18, 30, 32] and call["max_q"] == 12
    assert all(c["cu_q"] is call["cu_q"] for c in varlen_route)  # one offsets tensor per forward

    pa.route_for = va.route_for  # (monkeypatch restores it) the per-sample route, as on a CPU
    per_sample, g_per_sample = _logps_and_grads(model, packed)
    padded, g_padded = _logps_and_grads(model, SFTCollator(PAD)(rows()))
    for logps, grads in ((per_sample, g_per_sample), (padded, g_padded)):
        torch.testing.assert_close(varlen, logps, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g_varlen[name], g, rtol=1e-4, atol=1e-6)


def test_the_varlen_route_runs_in_the_autocast_dtype(varlen_route):
    """Rotary embeddings leave q/k in fp32 under autocast and a custom kernel is not cast by
    autocast: the wrapper casts to the autocast dtype (bf16), as sdpa's autocast would."""
    model = build_model("llama", vocab_size=64)
    enable_packed_attention(model)
    packed = pack_samples(rows(), PAD)
    varlen, _ = _logps_and_grads(model, packed, bf16=True)
    assert (
        {c["q"].dtype for c in varlen_route}
        == {c["k"].dtype for c in varlen_route}
        == {torch.bfloat16}
    )
    pa.route_for = va.route_for
    per_sample, _ = _logps_and_grads(model, packed, bf16=True)
    torch.testing.assert_close(varlen, per_sample, rtol=0.05, atol=0.05)


def test_the_flash_attn_route(monkeypatch):
    calls: list[dict] = []
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _reference_varlen(calls, flash=True)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(pa, "route_for", lambda query, dropout: ("flash_attn", "test"))
    model = build_model("llama", vocab_size=64)
    enable_packed_attention(model)
    packed = pack_samples(rows(), PAD)
    flash, _ = _logps_and_grads(model, packed)
    assert calls and calls[0]["causal"] is True and calls[0]["max_q"] == 12
    monkeypatch.setattr(pa, "route_for", va.route_for)
    per_sample, _ = _logps_and_grads(model, packed)
    torch.testing.assert_close(flash, per_sample, rtol=1e-5, atol=1e-5)


def test_without_host_lengths_the_row_is_read_once_per_forward(varlen_route):
    """A caller that passes no layout still gets one varlen call per layer; the lengths are then
    read off position_ids (the old path: one host read per forward)."""
    model = build_model("llama", vocab_size=64)
    enable_packed_attention(model)
    packed = pack_samples(rows(), PAD)
    with HostReads("cpu") as reads:
        _logps_and_grads(model, packed, layout=False)
    assert len(varlen_route) == model.config.num_hidden_layers
    assert any("sample_lengths" in site for _, site in reads.where)


def test_a_varlen_training_step_reads_the_device_back_once(tmp_path, varlen_route):
    model = build_model("llama", vocab_size=64)
    config = quiet_config(
        tmp_path, max_steps=3, batch_size=4, gradient_accumulation_steps=2, padding_free=True
    )
    data = rows((5, 2, 9, 3, 12)) * 4  # (every row with a trained token)
    trainer = GrimoireTrainer(model, build_tokenizer(), config, SFTLoss(), data)
    reads = step_reads(trainer)
    trainer.train()
    assert varlen_route and [len(r) for r in reads[1:]] == [1, 1]


# --------------------------------------------------------------------------- padding_free auto


def test_auto_packs_on_cuda_only_with_a_varlen_kernel(tmp_path, monkeypatch):
    long_tailed = [{"input_ids": [5] * n, "labels": [5] * n} for n in (2, 3, 40, 4)] * 2
    model = build_model("llama", vocab_size=64)
    auto = quiet_config(tmp_path, batch_size=4)
    cuda = types.SimpleNamespace(device=torch.device("cuda"), mixed_precision="bf16")

    def decide(kernels):
        monkeypatch.setattr(va, "available_kernels", lambda index=None: kernels)
        why = setup.cuda_varlen(model, auto, cuda)
        return packing_decision(SFTLoss(), auto, 0, None, model, long_tailed, "cuda", why)

    packed, why = decide(KERNELS)
    assert packed and "varlen_attn: one call per layer" in why and "unmeasured" in why
    packed, why = decide(va.Kernels(False, True, (8, 0)))
    assert packed and "flash_attn_varlen_func" in why
    packed, why = decide(va.Kernels(False, False, (9, 0)))
    assert not packed and why.startswith(AUTO_PACKING_CUDA_NOTE) and "no varlen kernel" in why
    cuda.mixed_precision = "no"  # fp32 on the GPU: the flash kernels do not take it
    packed, why = decide(KERNELS)
    assert not packed and "float32" in why
    assert isinstance(pack_samples(rows(), PAD)[LAYOUT_KEY], Packed)
    assert RowsHint("packed", torch.device("cpu"), (3, 4)).max_seqlen == 4
