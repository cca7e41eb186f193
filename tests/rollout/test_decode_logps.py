"""The HF engine's old log-probs recorded while decoding (``decode_logps``, the asynchronous
sampler's): equal to a plain full-logits forward over the sampled sequences (an independent
reference written here), at any temperature and top-k / top-p and across sampling chunks, and
obtained without that forward (observed by a hook on the decoder)."""

from __future__ import annotations

import pytest
import torch

from grimoire.forward.completions import position_ids_from_mask
from grimoire.rollout.engines.hf import HFGenerateEngine

PROMPTS = [[5, 9, 11, 7, 20, 21, 22, 8, 6], [12, 13], [30, 31, 32, 33, 34], [40]]


def _naive_logps(model, rollout, temperature):
    """``log softmax(logits / T)`` of every completion token from one full forward, 0 on padding."""
    ids, mask = rollout.input_ids, rollout.attention_mask
    c = rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits.float()
    logps = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logps[:, -c:] * rollout.completion_mask


def _generate_watched(engine, model):
    """``engine.generate(PROMPTS, 4)`` with old log-probs, and the ``input_ids`` shape of every
    decoder forward it made (a pre-hook on the decoder)."""
    rows: list[tuple[int, ...]] = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, k: rows.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    try:
        torch.manual_seed(7)
        rollout = engine.generate(PROMPTS, 4, with_old_logps=True)
    finally:
        hook.remove()
    return rollout, rows


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"generation_batch_size": 6},  # one prompt's 4 completions per sampling call
        {"prefill_once": False, "static_cache": False},
    ],
)
def test_decoded_old_logps_equal_a_full_forward(tiny_model, tokenizer, kw):
    engine = HFGenerateEngine(max_new_tokens=7, **kw)
    engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine.decode_logps = True
    rollout, rows = _generate_watched(engine, tiny_model)
    assert rollout.sampler_logps is None  # the policy's own: no mismatch to correct
    assert rollout.old_logps is not None and rollout.completion_mask.sum() > 8
    want = _naive_logps(tiny_model, rollout, kw.get("temperature", 1.0))
    torch.testing.assert_close(rollout.old_logps, want, atol=1e-5, rtol=0)
    # No forward over the whole sequences: every decoder call ran a prompt (prefill) or one
    # new token per row; the scored path adds one over prompt + completion.
    width = rollout.input_ids.shape[1]
    assert all(shape[1] < width for shape in rows), rows


def test_scored_old_logps_run_the_extra_forward(tiny_model, tokenizer):
    """The control: without ``decode_logps`` the old log-probs come from a forward over the
    whole sampled sequences (the hook above would see it)."""
    engine = HFGenerateEngine(max_new_tokens=7)
    engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    rollout, rows = _generate_watched(engine, tiny_model)
    assert rows[-1] == tuple(rollout.input_ids.shape)
    torch.testing.assert_close(rollout.old_logps, _naive_logps(tiny_model, rollout, 1.0))


def test_decoded_logps_do_not_change_the_samples(tiny_model, tokenizer):
    """Recording is read-only: the same seed samples the same completions with it and without."""
    out = []
    for record in (False, True):
        engine = HFGenerateEngine(max_new_tokens=7, temperature=0.9, top_k=8)
        engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
        engine.decode_logps = record
        torch.manual_seed(3)
        out.append(engine.generate(PROMPTS, 3, with_old_logps=False).completion_ids)
    assert torch.equal(out[0], out[1])
