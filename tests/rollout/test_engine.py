"""Rollout engine: layout, EOS handling, old log-probs vs generate's own scores, custom backends."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from grimoire.forward.completions import completion_logps, position_ids_from_mask
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.engines.generation import generation_mode
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.stage import RolloutStage, SamplingConfig


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(model, tokenizer, **kwargs) -> HFGenerateEngine:
    engine = HFGenerateEngine(**{"max_new_tokens": 6, **kwargs})
    engine.bind(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    return engine


def _prompts(tokenizer):
    return [tokenizer(p)["input_ids"] for p in ("reverse abc=", "reverse abcdef=", "hi")]


def test_layout_left_padded_prompt_major_and_eos(tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    torch.manual_seed(0)
    r = _engine(tiny_model, tokenizer).generate(prompts, 3)
    n, eos, pad = 9, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert r.prompt_ids.shape[0] == r.completion_ids.shape[0] == n and r.group_size == 3
    assert r.num_groups == 3
    for i in range(n):
        p = prompts[i // 3]
        width = r.prompt_ids.shape[1]
        assert r.prompt_ids[i, width - len(p) :].tolist() == p  # left padding, prompt-major
        assert r.prompt_mask[i].tolist() == [0] * (width - len(p)) + [1] * len(p)
        ids = r.completion_ids[i].tolist()
        length = int(r.completion_mask[i].sum())
        assert r.completion_mask[i].tolist() == [1] * length + [0] * (len(ids) - length)
        assert all(t == pad for t in ids[length:])
        body = ids[:length]
        assert eos not in body[:-1]  # nothing trained after the first EOS
        assert bool(r.truncated[i]) == (body[-1] != eos)
        assert length <= 6
    # old log-probs are exactly 0 on padding and negative on tokens
    assert (r.old_logps[r.completion_mask == 0] == 0).all()
    assert (r.old_logps[r.completion_mask == 1] < 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logps_match_generate_scores(tiny_model, tokenizer, temperature):
    """The no-grad scoring pass reproduces the (temperature-scaled, top-k/p-free) distribution
    ``generate`` sampled from: left padding and position ids line up."""
    engine = _engine(tiny_model, tokenizer, temperature=temperature)
    prompts = _prompts(tokenizer)
    torch.manual_seed(1)
    r = engine.generate(prompts, 2)
    torch.manual_seed(1)
    repeated = [p for p in prompts for _ in range(2)]
    width = max(map(len, repeated))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in repeated])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in repeated])
    with generation_mode(tiny_model):
        out = tiny_model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seq = out.sequences[:, width:]
    c = r.completion_ids.shape[1]
    assert (
        seq[:, :c].mul(r.completion_mask).tolist()
        == r.completion_ids.mul(r.completion_mask).tolist()
    )
    scores = torch.stack(out.scores, 1)[:, :c].float()  # already divided by the temperature
    naive = torch.log_softmax(scores, -1).gather(-1, seq[:, :c, None]).squeeze(-1)
    torch.testing.assert_close(naive * r.completion_mask, r.old_logps, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logps_match_unpadded_rows(tiny_model, tokenizer, temperature):
    """Left-padded batch vs one unpadded forward per row (T=1 runs through the shared
    grimoire.forward.logprobs module, other temperatures through the logits_to_keep path)."""
    eos = tokenizer.eos_token_id
    rows = [("reverse abc=", "cba"), ("hi", "ab")]
    prompts = [tokenizer(p)["input_ids"] for p, _ in rows]
    comps = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for _, c in rows]
    pw, cw = max(map(len, prompts)), max(map(len, comps))
    ids = torch.tensor(
        [[0] * (pw - len(p)) + p + c + [0] * (cw - len(c)) for p, c in zip(prompts, comps)]
    )
    mask = torch.tensor(
        [
            [0] * (pw - len(p)) + [1] * (len(p) + len(c)) + [0] * (cw - len(c))
            for p, c in zip(prompts, comps)
        ]
    )
    with torch.no_grad():
        got, entropy = completion_logps(tiny_model, ids, mask, cw, temperature, with_entropy=True)
        for b, (p, c) in enumerate(zip(prompts, comps)):
            logits = tiny_model(torch.tensor([p + c])).logits[0].float() / temperature
            lp = torch.log_softmax(logits, -1)
            naive = [float(lp[len(p) - 1 + t, tok]) for t, tok in enumerate(c)]
            naive_h = [
                float(-(lp[len(p) - 1 + t].exp() * lp[len(p) - 1 + t]).sum()) for t in range(len(c))
            ]
            assert got[b, : len(c)].tolist() == pytest.approx(naive, abs=1e-4)
            assert entropy[b, : len(c)].tolist() == pytest.approx(naive_h, abs=1e-4)
            assert (got[b, len(c) :] == 0).all()
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]


def test_generation_mode_restores_training_state(tiny_model, tokenizer):
    tiny_model.train()
    tiny_model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}
    )
    tiny_model.config.use_cache = False
    engine = _engine(tiny_model, tokenizer)
    engine.generate(_prompts(tokenizer)[:1], 2, with_old_logps=False)
    assert tiny_model.training and tiny_model.config.use_cache is False
    assert tiny_model.is_activation_checkpointing


def test_greedy_groups_are_identical(tiny_model, tokenizer):
    r = _engine(tiny_model, tokenizer).generate(_prompts(tokenizer), 2, greedy=True)
    assert torch.equal(r.completion_ids[0::2], r.completion_ids[1::2])
    assert r.old_logps is not None


class _ScriptedEngine(RolloutEngine):
    """A stand-in backend (what a vLLM engine implements): returns fixed completions."""

    def __init__(self, script):
        super().__init__(max_new_tokens=4)
        self.script = script
        self.synced = 0

    def sync_weights(self) -> None:
        self.synced += 1

    def _sample(self, prompts, n, greedy):
        return [list(self.script[i % len(self.script)]) for i in range(len(prompts) * n)]


def test_custom_backend_gets_padding_eos_cut_and_logps(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id
    engine = _ScriptedEngine([[10, eos, 11, 12], [10, 11, 12, 13, 14, 15], []])
    engine.bind(tiny_model, tokenizer.pad_token_id, eos)
    r = engine.generate(_prompts(tokenizer)[:1], 3)
    assert r.completion_ids.tolist()[0][:2] == [10, eos]
    assert r.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert r.truncated.tolist() == [False, True, True]
    assert (r.old_logps[2] == 0).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        HFGenerateEngine(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        HFGenerateEngine(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        HFGenerateEngine(max_new_tokens=0)
    with pytest.raises(RuntimeError, match="bind"):
        HFGenerateEngine().generate([[1, 2]], 2)


def test_bind_gives_the_token_budget_and_the_ranks_agreement_to_sampling_and_scoring(
    tiny_model, tokenizer
):
    eos = tokenizer.eos_token_id
    engine = _ScriptedEngine([[10, 11, 12, eos]])  # every completion 4 tokens (max_new_tokens)
    prompts = [[5, 6, 7], [5, 6, 8], [5, 6, 9]]
    # Sampling: a prompt's 2 completions cost 2 x (3 + 4) = 14 tokens; 28 fit two prompts.
    engine.bind(tiny_model, tokenizer.pad_token_id, eos, max_tokens=28, agree=lambda n: n + 1)
    assert engine.prompt_chunks(prompts, 2) == [prompts[:2], prompts[2:]]
    # Scoring: rows of width 3 + 4 = 7, so 28 // 7 = 4 rows per forward: 6 rows take 2 forwards,
    # and the ranks' agreement (here: one more than this rank's) adds one filler forward.
    calls = []
    hook = tiny_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        engine.generate(prompts, 2)
    finally:
        hook.remove()
    assert len(calls) == 3
    engine.bind(tiny_model, tokenizer.pad_token_id, eos)  # no limits: one call, no filler
    assert engine.prompt_chunks(prompts, 2) == [prompts]
    assert engine.max_tokens is None and engine.agree is None


def test_the_stage_binds_the_engine_with_the_runs_limits(tiny_model, tokenizer):
    engine = _ScriptedEngine([[10]])
    stage = RolloutStage(engine, [], SamplingConfig(num_generations=2), lambda ctx, g: ([], {}))

    def reduce_max(n: int) -> int:
        return n

    for sharded in (False, True):
        ctx = SimpleNamespace(
            unwrapped_model=tiny_model,
            tokenizer=tokenizer,
            config=SimpleNamespace(max_tokens_per_device=64, max_length=32),
            accelerator=SimpleNamespace(autocast=nullcontext),
            packed=False,
            sharded=sharded,
            all_reduce_max=reduce_max,
        )
        stage.bind(ctx)
        assert engine.model is tiny_model
        assert (engine.max_tokens, engine.max_length) == (64, 32)
        assert engine.agree is (reduce_max if sharded else None)
