"""Per-token log-probs: the fused chunked LM-head path against the full-logits path, and the full
path against a naive per-position reference.

Every parity test also asserts the fused path really ran (a silent fallback would make the
comparison trivially pass).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from grimoire.errors import ConfigError
from grimoire.forward import fused_head as fh
from grimoire.forward import logprobs as lp
from grimoire.forward.head import function as hfn
from grimoire.forward.logprobs import IGNORE_INDEX, compute_token_logps, shift_labels
from grimoire.model.tiny import tiny_config

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
#: bf16 autocast: both paths run the head in bf16 on the same hidden states, the fused one on a
#: row subset (another matmul blocking), and form dL/dlogits in fp32 by different op sequences
#: before rounding it to bf16. Measured on these tiny models (CPU): per-sequence sums identical,
#: gradients within 0.2-0.55% of the largest entry. Bounds leave ~4x margin for other kernels.
BF16_SEQ_TOL = {"atol": 5e-3, "rtol": 1e-3}
BF16_GRAD_REL = 2e-2  # max |g_fused - g_full| / max |g_full|, per parameter tensor


# conftest's fixture: one torch thread (deterministic reductions, no oversubscription).
pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(arch: str = "llama", tie: bool = True, seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny random fp32 CausalLM. Gemma-2 needs eager attention (no SDPA softcapping)."""
    torch.manual_seed(seed)
    config = tiny_config(arch, tie_word_embeddings=tie, **kw)
    impl = "eager" if arch == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def padded_batch(vocab: int = 64, seed: int = 1) -> dict[str, Tensor]:
    """4 rows x 12: full row; right padding; left padding; a row with no trained label at all."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # the prompt
    attn[1, 8:] = 0  # right padding
    ids[1, 8:] = 0
    labels[1, 8:] = IGNORE_INDEX
    attn[2, :4] = 0  # left padding
    ids[2, :4] = 0
    labels[2, :6] = IGNORE_INDEX
    labels[3] = IGNORE_INDEX  # fully masked row
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def fused_ran(model: torch.nn.Module) -> bool:
    state = fh._STATE.get(fh._unwrap(model))
    return state is not None and state.disabled is None and state.checked


def run(model, batch, *, fused, weights=None, entropy_weights=None, chunk_size=5, bf16=False, **kw):
    """Logps (+ entropy) and the gradients of a per-token-weighted loss.

    Random per-token weights make every row's upstream gradient different, as in DPO / GRPO.
    ``bf16``: forward under CPU bf16 autocast and backward outside it, as the trainer does.
    """
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = compute_token_logps(
            model,
            batch["input_ids"],
            batch["labels"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
            fused=fused,
            chunk_size=chunk_size,
            return_entropy=entropy_weights is not None,
            **kw,
        )
        w = weights if weights is not None else torch.ones_like(out.logps)
        loss = (out.logps * w).sum()
        if entropy_weights is not None:
            loss = loss + (out.entropy * entropy_weights).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_grads_close(ga: dict, gb: dict, **tol) -> None:
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


# --------------------------------------------------------------------------- references


def naive_token_logps(model, batch) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits)`` and entropy gathered with a Python loop, in float64."""
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
    ).logits.double()
    labels, pos = batch["labels"], batch.get("position_ids")
    b, t = labels.shape
    logps = torch.zeros(b, t, dtype=torch.float64)
    entropy = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t - 1):
            target = int(labels[i, j + 1])
            if target == IGNORE_INDEX or (pos is not None and int(pos[i, j + 1]) == 0):
                continue
            row = torch.log_softmax(logits[i, j], dim=-1)
            logps[i, j] = row[target]
            entropy[i, j] = -(row.exp() * row).sum()
    return logps, entropy


def test_full_path_matches_naive_reference():
    model = make_model("qwen2", tie=False)
    batch = padded_batch()
    ref_logps, ref_entropy = naive_token_logps(model, batch)
    for fused in (False, True):
        out, _ = run(model, batch, fused=fused, entropy_weights=torch.zeros(4, 12))
        torch.testing.assert_close(out.logps.double(), ref_logps, **FP32_TOL)
        torch.testing.assert_close(out.entropy.double(), ref_entropy, **FP32_TOL)
        assert out.logps.dtype == out.entropy.dtype == torch.float32
        assert torch.equal(out.mask, shift_labels(batch["labels"]) != IGNORE_INDEX)
    assert fused_ran(model)


# --------------------------------------------------------------------------- fused == full


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a self-check fallback would fail here
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_fused_matches_full_fp32(arch, tie):
    model = make_model(arch, tie=tie)
    batch = padded_batch()
    g = torch.Generator().manual_seed(2)
    w, ew = torch.rand(4, 12, generator=g), torch.rand(4, 12, generator=g)
    full, g_full = run(model, batch, fused=False, weights=w, entropy_weights=ew)
    fused, g_fused = run(model, batch, fused=True, weights=w, entropy_weights=ew)
    assert fused_ran(model)
    torch.testing.assert_close(fused.sum(), full.sum(), **FP32_TOL)
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    torch.testing.assert_close(fused.entropy, full.entropy, **FP32_TOL)
    assert torch.equal(fused.mask, full.mask)
    assert (fused.logps[3] == 0).all() and (fused.entropy[~fused.mask] == 0).all()
    assert_grads_close(g_fused, g_full, **FP32_TOL)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize(("arch", "tie"), [("llama", True), ("qwen2", False), ("gemma2", False)])
def test_fused_matches_full_bf16_autocast(arch, tie):
    model = make_model(arch, tie=tie)
    batch = padded_batch()
    w = torch.rand(4, 12, generator=torch.Generator().manual_seed(3))
    head_dtypes: list[torch.dtype] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: head_dtypes.append(out.dtype)
    )
    full, g_full = run(model, batch, fused=False, weights=w, bf16=True)
    fused, g_fused = run(model, batch, fused=True, weights=w, bf16=True)
    assert fused_ran(model)
    # Every head call ran under the caller's autocast: the full forward, the trimmed forward, the
    # self-check, and each chunk in forward *and* in its backward recompute.
    chunks = -(-int(fused.mask.sum()) // 5)
    assert head_dtypes == [torch.bfloat16] * (1 + 1 + 1 + 2 * chunks)
    assert fused.logps.dtype == torch.float32
    torch.testing.assert_close(fused.sum(), full.sum(), **BF16_SEQ_TOL)
    assert g_fused.keys() == g_full.keys()
    for name, g in g_full.items():
        rel = (g_fused[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert rel <= BF16_GRAD_REL, (name, float(rel))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "full"])
def test_packed_rows_match_padded(fused):
    """Two samples packed in one row (position_ids restart, no mask) == the same samples padded."""
    model = make_model("llama", tie=False)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, 64, (5,), generator=g), torch.randint(3, 64, (7,), generator=g)
    la, lb = a.clone(), b.clone()
    la[:2] = IGNORE_INDEX  # prompts
    lb[:3] = IGNORE_INDEX
    packed = {
        "input_ids": torch.cat([a, b])[None],
        "labels": torch.cat([la, lb])[None],
        "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None],
    }
    padded = {
        "input_ids": torch.stack([torch.cat([a, torch.zeros(2, dtype=a.dtype)]), b]),
        "labels": torch.stack([torch.cat([la, torch.full((2,), IGNORE_INDEX)]), lb]),
        "attention_mask": torch.tensor([[1] * 5 + [0] * 2, [1] * 7]),
    }
    out_packed, _ = run(model, packed, fused=fused, chunk_size=3)
    out_padded, _ = run(model, padded, fused=fused, chunk_size=3)
    per_sample = torch.stack([out_packed.logps[0, :5].sum(), out_packed.logps[0, 5:].sum()])
    torch.testing.assert_close(per_sample, out_padded.sum(), **FP32_TOL)
    # The boundary position (last of sample a -> first of sample b) is never a target.
    assert not out_packed.mask[0, 4]
    assert int(out_packed.mask.sum()) == int(out_padded.mask.sum())
    if fused:
        assert fused_ran(model)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_lora_model_parity_with_lora_on_the_head():
    from peft import LoraConfig, get_peft_model

    model = make_model("llama", tie=False)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "lm_head"],
        init_lora_weights=False,  # non-zero B, so the adapters change the outputs
    )
    model = get_peft_model(model, config)
    assert type(model.get_output_embeddings()).__module__.startswith("peft")  # LoRA-wrapped head
    batch = padded_batch()
    w = torch.rand(4, 12, generator=torch.Generator().manual_seed(5))
    full, g_full = run(model, batch, fused=False, weights=w)
    fused, g_fused = run(model, batch, fused=True, weights=w)
    assert fused_ran(model)
    assert any("lm_head.lora_A" in n for n in g_fused)  # the head's adapter is trained
    assert all("lora_" in n for n in g_fused)  # frozen base weights got no gradient
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_fused, g_full, **FP32_TOL)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_head_with_bias():
    model = make_model("llama", tie=False)
    head = torch.nn.Linear(64, 64, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_()
    model.lm_head = head
    batch = padded_batch()
    full, g_full = run(model, batch, fused=False)
    fused, g_fused = run(model, batch, fused=True)
    assert fused_ran(model)
    assert "lm_head.bias" in g_fused
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_fused, g_full, **FP32_TOL)


def test_no_grad_reference_pass_and_chunk_sizes():
    model = make_model("gemma2", tie=True)
    batch = padded_batch()
    with torch.no_grad():
        ref = compute_token_logps(model, **batch, fused=False).logps
        for chunk in (1, 7, 1024):
            out = compute_token_logps(model, **batch, fused=True, chunk_size=chunk)
            assert not out.logps.requires_grad
            torch.testing.assert_close(out.logps, ref, **FP32_TOL)
    assert fused_ran(model)


def test_all_rows_masked_still_backpropagates_zero():
    model = make_model("llama", tie=False)
    batch = padded_batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    out, grads = run(model, batch, fused=True)
    assert (out.logps == 0).all() and not out.mask.any()
    assert "lm_head.weight" in grads and all((g == 0).all() for g in grads.values())


def test_forward_wrapped_in_autocast_runs_head_in_same_precision():
    """accelerate wraps ``model.forward`` in autocast (the caller may not be in one): the head
    chunks must run under the autocast the model's own head saw, in forward and in backward."""
    model = make_model("qwen2", tie=False)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    head_dtypes: list[torch.dtype] = []
    model.lm_head.register_forward_hook(lambda _m, _a, out: head_dtypes.append(out.dtype))
    batch = padded_batch()
    full, g_full = run(model, batch, fused=False)
    fused, g_fused = run(model, batch, fused=True)
    assert fused_ran(model)
    assert head_dtypes == [torch.bfloat16] * len(head_dtypes) and len(head_dtypes) > 3
    torch.testing.assert_close(fused.sum(), full.sum(), **BF16_SEQ_TOL)
    for name, g in g_full.items():
        rel = (g_fused[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert rel <= BF16_GRAD_REL, (name, float(rel))


def test_dropout_in_head_is_replayed_in_backward():
    """LoRA dropout on the head: the recompute in backward must redraw the same mask."""
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(16, 40)).train()
    hidden = torch.randn(9, 16, requires_grad=True)
    targets = torch.randint(0, 40, (9,))
    params = list(head.parameters())
    spec = hfn._HeadSpec(head, [], False, "cpu", len(params), chunk_size=4)
    torch.manual_seed(7)
    out = hfn._HeadLogps.apply(hidden, targets, spec, *params)
    g_hidden, g_w = torch.autograd.grad(out.sum(), [hidden, params[0]])
    torch.manual_seed(7)  # the same mask, through plain autograd
    ref = lp.logps_from_logits(head(hidden), targets)
    r_hidden, r_w = torch.autograd.grad(ref.sum(), [hidden, params[0]])
    torch.testing.assert_close(out, ref, **FP32_TOL)
    torch.testing.assert_close(g_hidden, r_hidden, **FP32_TOL)
    torch.testing.assert_close(g_w, r_w, **FP32_TOL)


# --------------------------------------------------------------------------- self-check, fallbacks


def test_self_check_catches_undeclared_post_head_transform():
    model = make_model("llama", tie=False)

    def scale_logits(_module, _args, output):
        output.logits = output.logits * 1.5  # the model's own logits, behind the config's back
        return output

    model.register_forward_hook(scale_logits)
    batch = padded_batch()
    w = torch.rand(4, 12, generator=torch.Generator().manual_seed(6))
    with pytest.warns(RuntimeWarning, match="full-logits path"):
        fused, g_fused = run(model, batch, fused=True, weights=w)
    assert fh._STATE[model].disabled == "self-check mismatch"
    full, g_full = run(model, batch, fused=False, weights=w)
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_fused, g_full, **FP32_TOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; the fallback is permanent and silent
        again, _ = run(model, batch, fused=True, weights=w)
    torch.testing.assert_close(again.logps, full.logps, **FP32_TOL)


def test_self_check_catches_a_transform_missing_from_the_table(monkeypatch):
    """Without the softcapping entry the fused Gemma-2 head would be wrong: the check notices."""
    table = {k: v for k, v in lp.POST_HEAD_TRANSFORMS.items() if k != "final_logit_softcapping"}
    monkeypatch.setattr(lp, "POST_HEAD_TRANSFORMS", table)
    model = make_model("gemma2", tie=True)
    batch = padded_batch()
    with pytest.warns(RuntimeWarning, match="full-logits path"):
        fused, _ = run(model, batch, fused=True)
    full, _ = run(model, batch, fused=False)
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)


def _logit_shapes(model) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    model.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.logits.shape)))
    return shapes


def test_fallback_without_output_embeddings(monkeypatch, caplog):
    model = make_model("llama", tie=False)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    shapes = _logit_shapes(model)
    batch = padded_batch()
    with caplog.at_level(logging.INFO, logger="grimoire.forward.logprobs"):
        fused, g_fused = run(model, batch, fused=True)
        run(model, batch, fused=True)
    assert shapes == [(4, 12, 64)] * 2  # the full forward, both times
    assert sum("get_output_embeddings" in r.getMessage() for r in caplog.records) == 1  # once
    full, g_full = run(model, batch, fused=False)
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_fused, g_full, **FP32_TOL)


def test_fallback_when_head_is_sharded(caplog):
    model = make_model("llama", tie=False)
    model.lm_head.weight.ds_numel = model.lm_head.weight.numel()  # what ZeRO-3 tags params with
    shapes = _logit_shapes(model)
    with caplog.at_level(logging.INFO, logger="grimoire.forward.logprobs"):
        run(model, padded_batch(), fused=True)
    assert shapes == [(4, 12, 64)]
    assert any("sharded" in r.getMessage() for r in caplog.records)


def test_fused_forward_keeps_one_logit_per_row():
    model = make_model("llama", tie=False)
    shapes = _logit_shapes(model)
    run(model, padded_batch(), fused=True)
    run(model, padded_batch(), fused=True)
    assert shapes == [(4, 1, 64)] * 2


def test_chunk_size_must_be_positive():
    model = make_model("llama")
    batch = padded_batch()
    for fused in (True, False):
        for bad in (0, -3):
            with pytest.raises(ValueError, match="chunk_size"):
                compute_token_logps(model, **batch, fused=fused, chunk_size=bad)


def test_ddp_wrapped_model():
    """Through DistributedDataParallel (1-process gloo group): forward via DDP, grads synced."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    if dist.is_initialized():
        pytest.skip("another test left a default process group initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(f"{tmp}/store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            model = make_model("llama", tie=True)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            batch = padded_batch()
            full, g_full = run(ddp, batch, fused=False)
            fused, g_fused = run(ddp, batch, fused=True)
            assert fused_ran(ddp)
        finally:
            dist.destroy_process_group()
    g_full = {n.removeprefix("module."): g for n, g in g_full.items()}
    g_fused = {n.removeprefix("module."): g for n, g in g_fused.items()}
    torch.testing.assert_close(fused.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_fused, g_full, **FP32_TOL)


# --------------------------------------------------------------------------- memory


def test_fused_path_saves_no_batch_by_seq_by_vocab_tensor():
    """At vocab 32k / seq 256 the full path keeps [B, T, V] logits for backward; fused does not."""
    vocab, batch_size, seq, chunk = 32_000, 2, 256, 128
    model = make_model("llama", tie=False, vocab_size=vocab, hidden_size=32, num_layers=1)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=g)

    def saved(fused: bool) -> dict[int, int]:
        """Numel of every storage autograd keeps for backward (a tensor saved twice counts once)."""
        storages: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            storages[ptr] = max(storages.get(ptr, 0), t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compute_token_logps(model, ids, ids, fused=fused, chunk_size=chunk)
        out.logps.sum().backward()  # and the backward works
        return storages

    btv = batch_size * seq * vocab
    full, fused = saved(False), saved(True)
    assert max(full.values()) >= btv
    assert fused_ran(model)
    # Nothing logits-sized: the largest saved tensor is a weight (V x H), far below B x T x V.
    weight = vocab * 32
    assert max(fused.values()) <= weight < btv // 10
    # Everything saved: the two V x H weights plus small activations, vs logits on the full path.
    assert sum(fused.values()) < 3 * weight < sum(full.values()) / 5


# --------------------------------------------------------------------------- kernels


def test_apply_liger_explains_what_is_missing():
    import importlib.util

    from grimoire.model.liger import apply_liger

    if importlib.util.find_spec("liger_kernel") is not None and torch.cuda.is_available():
        pytest.skip("liger-kernel and CUDA are both present: nothing is missing")
    with pytest.raises(ConfigError) as err:
        apply_liger(make_model("llama"))
    text = str(err.value)
    if importlib.util.find_spec("liger_kernel") is None:
        assert "pip install 'grimoire[liger]'" in text
    if not torch.cuda.is_available():
        assert "CUDA" in text
