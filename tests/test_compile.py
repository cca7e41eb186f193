"""``torch_compile``: compiled training takes the same steps as eager; failures fall back.

The trainer tests compile with the ``aot_eager`` backend (dynamo graph capture + AOTAutograd's
joint forward/backward graphs, the parts that can change a training step's numbers) because
inductor's C++ code generation takes ~45 s per graph on this 2-core CPU; one test runs inductor
itself on a single forward/backward, the same graphs the trainer's blocks get. The fused
log-prob path hooks the decoder around the compiled blocks (checked: it stays on).
"""

from __future__ import annotations

import logging

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, quiet_config
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.forward.fused_head import fused_parts
from grimoire.losses.dpo import DPOLoss
from grimoire.losses.sft import SFTLoss
from grimoire.model import compiling
from grimoire.model.tiny import build_model, preference_rows
from grimoire.rows.preference import tokenize_preference


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    yield
    torch._dynamo.reset()  # compiled graphs must not leak into the next test


def _train(tiny_dir, tokenizer, rows, tmp_path, loss, **cfg):
    record = RecordLosses()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = quiet_config(tmp_path, max_steps=3, disable_dropout=True, **cfg)
    trainer = GrimoireTrainer(model, tokenizer, config, loss, rows, callbacks=[record])
    trainer.train()
    return trainer, [r["loss"] for r in record.records]


def test_compiled_sft_and_dpo_match_eager(tiny_dir, tokenizer, sft_rows, tmp_path, monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", "aot_eager")
    pairs = [tokenize_preference(r, tokenizer, 48) for r in preference_rows(12, seed=5)]
    for name, rows, make in (
        ("sft", sft_rows, SFTLoss),
        ("dpo", pairs, lambda: DPOLoss(ref_model="copy")),
    ):
        eager, eager_losses = _train(tiny_dir, tokenizer, rows, tmp_path / f"{name}e", make())
        compiled, losses = _train(
            tiny_dir, tokenizer, rows, tmp_path / f"{name}c", make(), torch_compile=True
        )
        assert eager.compile_state is None
        state = compiled.compile_state
        assert state.compiled and len(state.blocks) == 2, state.fallback_reason
        assert all(b._compiled_call_impl is not None for b in state.blocks)  # still compiled
        assert fused_parts(compiled.model) is not None  # the fused head path stays on
        ref = getattr(compiled.loss_fn, "reference", None)
        if ref is not None:  # the frozen copy runs eager (its blocks were not compiled)
            assert all(b._compiled_call_impl is None for b in compiling._blocks(ref.ref_model))
        assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)


def test_a_compile_failure_falls_back_to_eager_with_the_reason(
    tiny_dir, tokenizer, sft_rows, tmp_path, monkeypatch, caplog
):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("forced backend failure")

    monkeypatch.setattr(compiling, "BACKEND", broken_backend)
    _, eager_losses = _train(tiny_dir, tokenizer, sft_rows, tmp_path / "e", SFTLoss())
    with caplog.at_level(logging.WARNING, logger="grimoire.model.compiling"):
        trainer, losses = _train(
            tiny_dir, tokenizer, sft_rows, tmp_path / "c", SFTLoss(), torch_compile=True
        )
    state = trainer.compile_state
    assert not state.compiled and "forced backend failure" in state.fallback_reason
    assert all(b._compiled_call_impl is None for b in state.blocks)
    assert "running eager" in caplog.text and "forced backend failure" in caplog.text
    assert losses == pytest.approx(eager_losses, rel=1e-6)  # the failed call was re-run eagerly


def test_unusable_settings_fall_back_before_compiling(monkeypatch, caplog):
    model = build_model(seed=0)
    with caplog.at_level(logging.WARNING, logger="grimoire.model.compiling"):
        state = compiling.compile_blocks(model, mode="no-such-mode")
    assert not state.compiled and "no-such-mode" in state.fallback_reason
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    if not torch.cuda.is_available():
        state = compiling.compile_blocks(model)
        assert "C++ compiler" in state.fallback_reason
    state = compiling.compile_blocks(torch.nn.Linear(2, 2))
    assert "no transformer blocks" in state.fallback_reason


@pytest.mark.slow  # ~40 s: inductor generates and builds C++ for the forward and backward graphs
def test_inductor_block_matches_eager():
    """The real default backend (inductor, C++ codegen on CPU): same loss and gradients."""
    torch.manual_seed(0)
    eager, compiled = build_model(seed=0), build_model(seed=0)
    state = compiling.compile_blocks(compiled)
    assert state.compiled
    ids = torch.randint(0, 30, (2, 12))
    losses = []
    for model in (eager, compiled):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert state.compiled, state.fallback_reason  # no silent fallback during the call
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
