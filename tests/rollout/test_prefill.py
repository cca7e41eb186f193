"""HF engine, one prefill per prompt: the same samples as prefilling every completion's copy of
the prompt, with the prompt tokens run once per prompt (observed by a hook on the decoder)."""

from __future__ import annotations

import pytest
import torch

from grimoire.rollout.hf import HFGenerateEngine

# Lengths 1 .. 9: left padding inside a chunk, and a chunk of one-token prompts.
PROMPTS = [[5, 9, 11, 7, 20, 21, 22, 8, 6], [12, 13], [30, 31, 32, 33, 34], [40]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sample(model, tokenizer, prompts, n, *, prefill_once, greedy=False, **kw):
    engine = HFGenerateEngine(max_new_tokens=7, prefill_once=prefill_once, **kw)
    engine.bind(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    tokens: list[tuple[int, int]] = []  # (rows, positions) of every decoder forward
    hook = model.model.register_forward_pre_hook(
        lambda m, a, k: tokens.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    try:
        torch.manual_seed(123)
        rollout = engine.generate(prompts, n, with_old_logps=False, greedy=greedy)
    finally:
        hook.remove()
    return rollout.completion_ids.tolist(), tokens


@pytest.mark.parametrize("kw", [{}, {"top_k": 5, "temperature": 0.7}, {"top_p": 0.8}])
def test_one_prefill_samples_what_repeated_prefill_samples(tiny_model, tokenizer, kw):
    n = 4
    once, _ = _sample(tiny_model, tokenizer, PROMPTS, n, prefill_once=True, **kw)
    every, _ = _sample(tiny_model, tokenizer, PROMPTS, n, prefill_once=False, **kw)
    assert once == every
    # The sampling is really random: the 4 completions of one prompt are not all equal.
    assert any(len({tuple(r) for r in once[i * n : (i + 1) * n]}) > 1 for i in range(len(PROMPTS)))


def test_one_prefill_greedy_and_chunked(tiny_model, tokenizer):
    for chunking in ({}, {"generation_batch_size": 4}):
        once, _ = _sample(tiny_model, tokenizer, PROMPTS, 3, prefill_once=True, greedy=True,
                          **chunking)  # fmt: skip
        every, _ = _sample(tiny_model, tokenizer, PROMPTS, 3, prefill_once=False, greedy=True,
                           **chunking)  # fmt: skip
        assert once == every


def test_prompt_tokens_run_once_per_prompt(tiny_model, tokenizer):
    """The decoder sees each prompt's first L - 1 tokens once (P rows), then the N = P * n rows
    one token at a time; without it, the first forward is N rows of the whole prompt."""
    n, width = 8, max(map(len, PROMPTS))
    _, once = _sample(tiny_model, tokenizer, PROMPTS, n, prefill_once=True)
    _, every = _sample(tiny_model, tokenizer, PROMPTS, n, prefill_once=False)
    rows = len(PROMPTS) * n
    assert once[0] == (len(PROMPTS), width - 1)
    assert all(shape == (rows, 1) for shape in once[1:])
    assert every[0] == (rows, width)
    assert all(shape == (rows, 1) for shape in every[1:])
    prompt_tokens = {k: v[0][0] * v[0][1] + rows for k, v in (("once", once), ("every", every))}
    assert prompt_tokens["once"] * 4 < prompt_tokens["every"]
