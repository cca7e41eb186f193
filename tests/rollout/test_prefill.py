"""HF engine, one prefill per prompt: the same samples as prefilling every completion's copy of
the prompt, with the prompt tokens run once per prompt (observed by a hook on the decoder)."""

from __future__ import annotations

import pytest
import torch

from grimoire.rollout.engines.hf import HFGenerateEngine

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
        once, _ = _sample(
            tiny_model, tokenizer, PROMPTS, 3, prefill_once=True, greedy=True, **chunking
        )
        every, _ = _sample(
            tiny_model, tokenizer, PROMPTS, 3, prefill_once=False, greedy=True, **chunking
        )
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


def _plain_generate(model, tokenizer, prompts, n, **kw):
    """Today's samples: ``model.generate`` by itself (its own prefill of every repeated prompt,
    its default ``DynamicCache``), the seed and sampling settings the engine uses."""
    from transformers import GenerationConfig

    from grimoire.collate.common import pad_sequences
    from grimoire.rollout.engines.generation import generation_mode

    ids, mask = pad_sequences(prompts, tokenizer.pad_token_id, left=True, min_width=2)
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=7,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        temperature=kw.get("temperature", 1.0),
        top_k=kw.get("top_k", 0),
        top_p=kw.get("top_p", 1.0),
    )
    torch.manual_seed(123)
    with torch.no_grad(), generation_mode(model):
        gen = model.generate(
            input_ids=ids.repeat_interleave(n, 0),
            attention_mask=mask.repeat_interleave(n, 0),
            generation_config=config,
        )
    rows = gen[:, ids.shape[1] :].tolist()
    pad = tokenizer.pad_token_id
    return [[t for t in r if t != pad] for r in rows]


@pytest.mark.parametrize("kw", [{}, {"top_k": 5, "temperature": 0.7}])
def test_static_cache_samples_what_plain_generate_samples(tiny_model, tokenizer, kw):
    """Both cache kinds, with and without the shared prefill, against ``model.generate`` alone."""
    n = 3
    plain = _plain_generate(tiny_model, tokenizer, PROMPTS, n, **kw)
    for prefill_once in (True, False):
        for static in (True, False):
            got, _ = _sample(
                tiny_model,
                tokenizer,
                PROMPTS,
                n,
                prefill_once=prefill_once,
                static_cache=static,
                **kw,
            )
            pad = tokenizer.pad_token_id
            assert [[t for t in r if t != pad] for r in got] == plain, (prefill_once, static)


def _cache_storage(model, tokenizer, **kw):
    """The first layer's key storage seen by every decoding step's forward."""
    ptrs: list[int] = []

    def after(module, args, kwargs, out):
        cache = out.get("cache") or out.get("past_key_values")
        ptrs.append(cache.layers[0].keys.untyped_storage().data_ptr())

    hook = model.model.register_forward_hook(after, with_kwargs=True)
    try:
        _sample(model, tokenizer, PROMPTS, 2, **kw)
    finally:
        hook.remove()
    return ptrs


@pytest.mark.parametrize("prefill_once", [True, False])
def test_static_cache_is_written_in_place(tiny_model, tokenizer, prefill_once):
    """Observed on the cache tensors themselves: with the static cache every decoding step
    writes into the storage the first step used; the dynamic cache reallocates it each step."""
    static = _cache_storage(tiny_model, tokenizer, prefill_once=prefill_once, static_cache=True)
    dynamic = _cache_storage(tiny_model, tokenizer, prefill_once=prefill_once, static_cache=False)
    assert len(static) == len(dynamic) >= 7
    assert len(set(static[1:])) == 1
    # Consecutive steps: the concatenated cache is allocated while the old one is still alive.
    assert all(a != b for a, b in zip(dynamic[1:], dynamic[2:]))


def test_sliding_window_layers_with_prompts_past_the_window():
    """Gemma2's static sliding-window layers (window 8, prompts of 21 tokens + 12 new): every
    combination samples what plain ``generate`` with its dynamic cache samples."""
    from grimoire.model.tiny import build_model

    model = build_model("gemma2", seed=0, sliding_window=8)
    prompts = [list(range(5, 26)), [7, 8]]
    got = {}
    for prefill_once in (True, False):
        for static in (True, False):
            engine = HFGenerateEngine(
                max_new_tokens=12, prefill_once=prefill_once, static_cache=static
            )
            engine.bind(model, pad_token_id=0, eos_token_id=None)
            torch.manual_seed(1)
            rollout = engine.generate(prompts, 3, with_old_logps=False)
            got[prefill_once, static] = rollout.completion_ids.tolist()
    assert all(v == got[False, False] for v in got.values())
