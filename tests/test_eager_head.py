"""The fused head's eager route (``uniform_grad=True``): gradients computed during the forward.

Checked against the full-logits path (exact up to float rounding) and against the recompute
route, and observed directly: the head's matmuls are counted with a dispatch mode, so a test
fails if the eager route silently recomputes (or the recompute route silently goes eager).
"""

from __future__ import annotations

import pytest
import torch
from tests.test_logprobs import (
    BF16_GRAD_REL,
    BF16_SEQ_TOL,
    FP32_TOL,
    assert_grads_close,
    fused_ran,
    padded_batch,
    run,
)
from tests.test_logprobs import (
    make_model as _make_model,
)
from torch.utils._python_dispatch import TorchDispatchMode

from grimoire.forward.head import function as hfn
from grimoire.forward.head import workspace as ws
from grimoire.forward.logprobs import release_buffers
from grimoire.losses import SFTLoss

VOCAB = 64  # tiny_config's vocabulary
CHUNK = 5


def make_model(arch: str = "llama", tie: bool = True, **kw) -> torch.nn.Module:
    """The tiny test model with a hidden size unlike the vocabulary, so only the LM head's
    matmuls have a ``VOCAB``-sized dimension."""
    return _make_model(arch, tie=tie, hidden_size=48, **kw)


# conftest's fixture: one torch thread (deterministic reductions, no oversubscription).
pytestmark = pytest.mark.usefixtures("one_thread")


class HeadMatmuls(TorchDispatchMode):
    """Counts the matmuls of the head's chunks: a vocabulary-sized and a chunk-sized dimension
    (the model's own ``logits_to_keep=1`` head call has batch-size rows, 4, not ``CHUNK``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
            dims = {d for a in args if isinstance(a, torch.Tensor) for d in a.shape}
            if VOCAB in dims and CHUNK in dims:
                self.count += 1
        return func(*args, **(kwargs or {}))


def n_chunks(batch) -> int:
    targets = int((batch["labels"][:, 1:] != -100).sum())
    assert targets % CHUNK == 0  # every chunk CHUNK rows, so HeadMatmuls sees them all
    return targets // CHUNK


def counted(model, batch, **kw):
    with HeadMatmuls() as mm:
        out, grads = run(model, batch, fused=True, chunk_size=CHUNK, **kw)
    return out, grads, mm.count


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_eager_matches_full_and_skips_the_recompute(arch, tie):
    model = make_model(arch, tie=tie)
    batch = padded_batch()
    w = torch.full((4, 12), -1 / 37)  # a token-mean NLL: one upstream grad for every token
    full, g_full = run(model, batch, fused=False, weights=w)
    eager, g_eager, mm_eager = counted(model, batch, weights=w, uniform_grad=True)
    assert fused_ran(model)
    _recompute, g_rec, mm_rec = counted(model, batch, weights=w)
    torch.testing.assert_close(eager.logps, full.logps, **FP32_TOL)
    assert_grads_close(g_eager, g_full, **FP32_TOL)
    assert_grads_close(g_rec, g_full, **FP32_TOL)
    # logits + 2 gradient matmuls per chunk, against logits + recompute + 2 in backward.
    chunks = n_chunks(batch)
    assert (mm_eager, mm_rec) == (3 * chunks, 4 * chunks)


def test_eager_under_bf16_autocast():
    model = make_model("llama", tie=False)
    batch = padded_batch()
    w = torch.full((4, 12), 0.25)
    full, g_full = run(model, batch, fused=False, weights=w, bf16=True)
    eager, g_eager, mm = counted(model, batch, weights=w, bf16=True, uniform_grad=True)
    assert mm == 3 * n_chunks(batch)
    torch.testing.assert_close(eager.sum(), full.sum(), **BF16_SEQ_TOL)
    for name, g in g_full.items():
        rel = (g_eager[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert rel <= BF16_GRAD_REL, (name, float(rel))


def test_broken_promise_falls_back_to_the_exact_recompute():
    """Per-token weights (DPO-like) under uniform_grad=True: still exact, via the recompute."""
    model = make_model("llama", tie=False)
    batch = padded_batch()
    w = torch.rand(4, 12, generator=torch.Generator().manual_seed(3))
    _full, g_full = run(model, batch, fused=False, weights=w)
    _out, g, mm = counted(model, batch, weights=w, uniform_grad=True)
    assert_grads_close(g, g_full, **FP32_TOL)
    # The eager route's 3 matmuls per chunk are wasted, then recompute + 2 gradient matmuls.
    assert mm == 3 * n_chunks(batch) + 3 * n_chunks(batch)


def test_entropy_in_the_loss_falls_back_and_stays_exact():
    model = make_model("llama", tie=False)
    batch = padded_batch()
    w = torch.full((4, 12), -0.5)
    ew = torch.rand(4, 12, generator=torch.Generator().manual_seed(4))
    full, g_full = run(model, batch, fused=False, weights=w, entropy_weights=ew)
    out, g = run(
        model, batch, fused=True, chunk_size=CHUNK, weights=w, entropy_weights=ew, uniform_grad=True
    )
    torch.testing.assert_close(out.entropy, full.entropy, **FP32_TOL)
    assert_grads_close(g, g_full, **FP32_TOL)


def test_logged_entropy_keeps_the_eager_route():
    """Entropy returned but not differentiated (a metric): the eager route still applies."""
    model = make_model("llama", tie=False)
    batch = padded_batch()
    w = torch.full((4, 12), 1.0)
    with HeadMatmuls() as mm:
        model.zero_grad(set_to_none=True)
        out = fh_compute(model, batch, return_entropy=True, uniform_grad=True)
        (out.logps * w).sum().backward()
    full, g_full = run(model, batch, fused=False, weights=w, entropy_weights=torch.zeros(4, 12))
    torch.testing.assert_close(out.entropy, full.entropy, **FP32_TOL)
    g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_close(g, g_full, **FP32_TOL)
    assert mm.count == 3 * n_chunks(batch)


def fh_compute(model, batch, **kw):
    from grimoire.forward.logprobs import compute_token_logps

    return compute_token_logps(
        model,
        batch["input_ids"],
        batch["labels"],
        attention_mask=batch["attention_mask"],
        fused=True,
        chunk_size=CHUNK,
        **kw,
    )


def test_head_with_bias_and_softcapped_head():
    """A biased Linear (hand-written route) and Gemma-2's softcapping (autograd route)."""
    biased = make_model("llama", tie=False)
    biased.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.1)
    gemma = make_model("gemma2", tie=False, final_logit_softcapping=3.0)
    for model in (biased, gemma):
        batch = padded_batch()
        w = torch.full((4, 12), -0.1)
        full, g_full = run(model, batch, fused=False, weights=w)
        out, g, mm = counted(model, batch, weights=w, uniform_grad=True)
        assert fused_ran(model)
        assert mm == 3 * n_chunks(batch)
        torch.testing.assert_close(out.logps, full.logps, **FP32_TOL)
        assert_grads_close(g, g_full, **FP32_TOL)


def test_lora_on_the_head_goes_through_autograd():
    peft = pytest.importorskip("peft")
    model = make_model("llama", tie=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():  # non-zero B so the LoRA branch matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch = padded_batch()
    w = torch.full((4, 12), 0.3)
    full, g_full = run(model, batch, fused=False, weights=w)
    out, g, mm = counted(model, batch, weights=w, uniform_grad=True)
    assert fused_ran(model)
    torch.testing.assert_close(out.logps, full.logps, **FP32_TOL)
    assert_grads_close(g, g_full, **FP32_TOL)
    _, _, mm_recompute = counted(model, batch, weights=w)
    # Base layer and lora_B each run once per chunk fewer than on the recompute route.
    assert mm_recompute - mm == 2 * n_chunks(batch)


def test_a_hooked_head_is_called_as_a_module():
    model = make_model("llama", tie=False)
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    batch = padded_batch()
    w = torch.full((4, 12), 1.0)
    _full, g_full = run(model, batch, fused=False, weights=w)
    calls.clear()
    _out, g = run(model, batch, fused=True, chunk_size=CHUNK, weights=w, uniform_grad=True)
    assert len(calls) == 1 + 1 + n_chunks(batch)  # forward, self-check, one per chunk
    assert_grads_close(g, g_full, **FP32_TOL)


def test_second_backward_recomputes_exactly():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40)
    hidden = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 40, (11,))
    params = list(head.parameters())
    spec = hfn._HeadSpec(head, [], False, "cpu", len(params), chunk_size=4, uniform_grad=True)
    out = hfn._HeadLogps.apply(hidden, targets, spec, *params)
    first = torch.autograd.grad(out.sum(), [hidden, *params], retain_graph=True)
    second = torch.autograd.grad(out.sum(), [hidden, *params])  # eager results already used
    ref_out = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    ref = torch.autograd.grad(ref_out.sum(), [hidden, *params])
    for a, b, r in zip(first, second, ref):
        torch.testing.assert_close(a, r, **FP32_TOL)
        torch.testing.assert_close(b, r, **FP32_TOL)


def test_cpu_workspace_is_shared_and_reused_across_calls():
    """One CPU logits buffer serves every plain-Linear head call (forward, recompute, another
    model) instead of a fresh mmap'd one per call; results do not depend on its old contents."""
    release_buffers()
    model, other = make_model("llama", tie=False), make_model("llama", tie=False, seed=1)
    batch = padded_batch()
    with torch.no_grad():
        first = fh_compute(model, batch)
        ptr = ws._WORKSPACE.buffers["logits"].data_ptr()
        fh_compute(other, batch)
        again = fh_compute(model, batch)
    run(model, batch, fused=True, chunk_size=CHUNK)  # the recompute route uses it too
    assert ws._WORKSPACE.buffers["logits"].data_ptr() == ptr
    assert ws._WORKSPACE.buffers["logits"].numel() == CHUNK * VOCAB
    torch.testing.assert_close(first.logps, again.logps, rtol=0, atol=0)
    # bf16 logits get their fp32 block in a second reused buffer, for statistics and gradients.
    full, g_full = run(model, batch, fused=False, bf16=True)
    bf16_runs = [run(model, batch, fused=True, chunk_size=CHUNK, bf16=True) for _ in range(2)]
    buffers = ws._WORKSPACE.buffers
    # ...and so do the bf16 cast of the head weight and the eager route's bf16 weight gradient.
    ptrs = {k: buffers[k].data_ptr() for k in ("fp32", "weight")}
    eager, eager_again = (
        run(model, batch, fused=True, chunk_size=CHUNK, bf16=True, uniform_grad=True)
        for _ in range(2)
    )
    ptrs_after = {k: buffers[k].data_ptr() for k in ("fp32", "weight")}
    assert ptrs_after == ptrs and buffers["dweight"].dtype == torch.bfloat16
    assert_grads_close(eager[1], eager_again[1], rtol=0, atol=0)
    torch.testing.assert_close(bf16_runs[0][0].logps, bf16_runs[1][0].logps, rtol=0, atol=0)
    assert_grads_close(bf16_runs[0][1], bf16_runs[1][1], rtol=0, atol=0)
    for out, grads in (bf16_runs[1], eager):
        torch.testing.assert_close(out.sum(), full.sum(), **BF16_SEQ_TOL)
        for name, g in g_full.items():
            rel = (grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
            assert rel <= BF16_GRAD_REL, (name, float(rel))
    release_buffers()
    assert not hasattr(ws._WORKSPACE, "buffers")


def test_sft_loss_takes_the_eager_route_and_matches_the_full_path():
    model = make_model("llama", tie=False)
    batch = padded_batch()
    grads = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss_fn = SFTLoss(fused=fused, fused_chunk_size=CHUNK)
        with HeadMatmuls() as mm:
            loss, _ = loss_fn(model, batch)
            loss.backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if fused:
            assert mm.count == 3 * n_chunks(batch)
    assert_grads_close(grads[True], grads[False], **FP32_TOL)


def test_training_releases_the_cpu_workspace(tmp_path):
    from tests.helpers.train_utils import quiet_config

    from grimoire import GrimoireTrainer
    from grimoire.model.tiny import build_tokenizer

    rows = [{"input_ids": [1, 5, 6, 7, 8], "labels": [-100, 5, 6, 7, 8]}] * 4
    seen = []

    class Probe:  # the buffer exists during training...
        def __getattr__(self, name):
            if name == "on_step_end":
                return lambda *a, **k: seen.append(getattr(ws._WORKSPACE, "buffers", None))
            raise AttributeError(name)

    trainer = GrimoireTrainer(
        make_model("llama"),
        build_tokenizer(),
        quiet_config(tmp_path, max_steps=2, batch_size=2),
        SFTLoss(),
        rows,
        callbacks=[Probe()],
    )
    trainer.train()
    assert seen and all(buf is not None for buf in seen)
    assert not hasattr(ws._WORKSPACE, "buffers")  # ...and is freed when it ends
