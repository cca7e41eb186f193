"""Multi-turn episodes sampled by the colocated vLLM engine: several episodes in lockstep, each
sampled token's vLLM log-prob recorded where the policy scores it in the whole episode; and a GRPO
step on episodes through the trainer's rollout stage with ``engine: vllm`` and with
``engine: vllm-server`` (a real ``grimoire vllm-serve``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.helpers.episodes import (
    Chatty,
    Narrator,
    answer_length,
    assert_only_model_tokens_get_gradient,
)
from tests.helpers.train_utils import quiet_config
from tests.vllm_backend.common import TINY, start_server
from tests.vllm_backend.test_vllm_ddp import _env
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer
from grimoire.collate.prompts import GRPOCollator
from grimoire.forward.completions import completion_logps
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_model, build_tokenizer, reverse_rows
from grimoire.rollout.agents.episode_batches import engine_generate_batch, pad_episodes
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episodes
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.engines.vllm_engine import VLLMEngine
from grimoire.rows.prompts import tokenize_grpo


def test_environment_episodes_with_vllm_record_the_samplers_logps_per_model_token():
    tok = build_tokenizer()
    model = build_model("llama", seed=0, vocab_size=64, **TINY).eval()
    # Any letter ends a turn too: a random model then ends its turns within a few tokens.
    stops = [tok.convert_tokens_to_ids(c) for c in ["<|end|>", *"abcdefghijkl"]]
    engine = VLLMEngine(max_new_tokens=10)
    engine.bind(model, tok.pad_token_id, stops)
    try:
        rows = [{"prompt": "reverse abc="}, {"prompt": "reverse hello="}, {"prompt": "hi"}]
        episodes = run_episodes(
            rows,
            [Chatty() for _ in rows],
            engine_generate_batch(engine),
            tok,
            parse_tiny,
            EpisodeLimits(max_turns=4, max_new_tokens=10, max_tokens=160),
            stop_token_ids=stops,
        )
    finally:
        engine.close()
    assert max(e.turns for e in episodes) >= 2, [(e.stop_reason, e.turns) for e in episodes]
    batch = pad_episodes(episodes, tok.pad_token_id)
    mask = batch["completion_mask"].bool()
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _ = completion_logps(model, batch["input_ids"], batch["attention_mask"], width)
    # fp32 on both sides: vLLM's log-prob of each drawn token (sampled turn by turn) is the
    # policy's log-prob of that token in the whole episode.
    assert (batch["sampler_logps"][mask] - logps[mask]).abs().max() < 1e-4
    assert (batch["sampler_logps"][~mask] == 0).all()


@pytest.fixture(scope="module")
def server(vllm_tiny):
    proc, url = start_server(vllm_tiny, _env())
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("kind", ["vllm", "vllm-server"])
def test_environment_grpo_step_with_vllm_through_the_stage(vllm_tiny, tmp_path, request, kind):
    engine_spec: Any = kind
    if kind == "vllm-server":  # a real `grimoire vllm-serve` (vLLM behind the HTTP server)
        engine_spec = {"type": kind, "args": {"url": request.getfixturevalue("server")}}
    tok = AutoTokenizer.from_pretrained(vllm_tiny)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(8, seed=3)]
    config = quiet_config(
        tmp_path,
        max_steps=1,
        batch_size=2,
        disable_dropout=True,
        seed=0,
        learning_rate=1e-2,
        padding_free=False,
        lr_scheduler="constant",
    )
    method = GRPOMethod(
        [answer_length],
        num_generations=4,
        engine=engine_spec,
        environment=Narrator,
        # Any letter ends a turn too: a random model then ends its turns within a few tokens
        # (27 of 64 tokens end a turn: 16 tokens without one are a chance of 2e-4).
        stop_tokens=["<|end|>", *"abcdefghijklmnopqrstuvwxyz"],
        tool_call_parser="tiny",
        max_turns=3,
        max_episode_tokens=128,
        max_new_tokens=16,
        fused=False,
    )
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny, dtype=torch.float32)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=method, train_dataset=rows
    )
    try:
        prompts = GRPOCollator(pad_token_id=tok.pad_token_id)(rows[:2])
        batches, metrics, _ = trainer.rollouts.step(trainer.context, [(prompts, 1.0)])
        batch = batches[0][0]
        policy = trainer.context.unwrapped_model
        mask = batch["completion_mask"]
        c = mask.shape[1]
        context = (batch["attention_mask"][:, -c:] == 1) & (mask == 0)
        assert context.any(dim=1).all(), "every episode has tool tokens in its completion"
        assert metrics["episode/turns_mean"] == 2.0
        with torch.no_grad():
            logps, _ = completion_logps(policy, batch["input_ids"], batch["attention_mask"], c)
        # vLLM's log-prob of each sampled token (fp32 CPU) is the policy's in the whole episode;
        # nothing is recorded on the tool and template tokens.
        assert (batch["sampler_logps"] - logps)[mask.bool()].abs().max() < 1e-4
        assert (batch["sampler_logps"][~mask.bool()] == 0).all()

        assert_only_model_tokens_get_gradient(trainer, policy, batch)

        trainer.train()  # one step through the stage: episodes, loss, update
        engine = method.engine
        moved = max(
            float((p.detach() - start[n]).abs().max()) for n, p in policy.named_parameters()
        )
        assert moved > 1e-3
        synced = engine.syncs
        rollout = engine.generate([r["prompt_input_ids"] for r in rows[:2]], 4)
        assert engine.syncs == synced + 1  # the trained weights went to vLLM before sampling
        gap = (rollout.old_logps - rollout.sampler_logps).abs()[rollout.completion_mask.bool()]
        assert float(gap.max()) < 1e-3  # vLLM samples from the trained policy
    finally:
        trainer.close()
