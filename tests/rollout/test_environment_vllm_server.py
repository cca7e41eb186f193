"""GRPO on multi-turn episodes through the trainer's rollout stage with the ``vllm-server``
engine, against the real HTTP handler of ``grimoire vllm-serve`` serving a stand-in sampler (no
vLLM): every turn is one request, the sampler's reported log-probs land on the model's tokens
only, tool tokens get no gradient, and the trained weights are pushed before the next sampling.

The same with a real vLLM server is in tests/vllm_backend."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.episodes import (
    LOGP,
    Narrator,
    answer_length,
    assert_only_model_tokens_get_gradient,
)
from tests.helpers.stand_in_server import serving_turns
from tests.helpers.train_utils import quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer
from grimoire.collate.prompts import GRPOCollator
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rows.prompts import tokenize_grpo


@pytest.fixture
def served(tiny_dir):
    with serving_turns(tiny_dir) as served:
        yield served


def test_environment_grpo_step_with_the_vllm_server_engine(served, tiny_dir, tmp_path):
    sampler, url = served
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    end = tok.convert_tokens_to_ids("<|end|>")
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
        engine={"type": "vllm-server", "args": {"url": url}},
        environment=Narrator,
        stop_tokens=["<|end|>"],
        tool_call_parser="tiny",
        max_turns=3,
        max_episode_tokens=96,
        max_new_tokens=8,
        fused=False,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=method, train_dataset=rows
    )
    try:
        prompts = GRPOCollator(pad_token_id=tok.pad_token_id)(rows[:2])
        batches, metrics, _ = trainer.rollouts.step(trainer.context, [(prompts, 1.0)])
        batch = batches[0][0]
        policy = trainer.context.unwrapped_model
        assert metrics["episode/turns_mean"] == 2.0
        assert metrics["episode/stop/done"] == 8.0  # every episode ended by the environment
        # Turn by turn: the first request the 2 prompts x 4, the second each episode's history.
        assert [len(r["prompts"]) for r in sampler.requests] == [8, 8]
        assert all(end in p["stop_token_ids"] for p in sampler.requests[0]["params"])
        first, second = sampler.requests
        for a, b in zip(first["prompts"], second["prompts"], strict=True):
            assert b[: len(a)] == a and len(b) > len(a) + 2  # the turn and the tool's message

        mask = batch["completion_mask"]
        c = mask.shape[1]
        context = (batch["attention_mask"][:, -c:] == 1) & (mask == 0)
        assert context.any(dim=1).all(), "every episode has tool tokens in its completion"
        # The server's log-probs on the model's tokens only (the IS correction's).
        torch.testing.assert_close(batch["sampler_logps"], LOGP * mask.float())
        assert int(mask.sum()) == sampler.sent  # every token the server sent, trained once
        assert batch["advantages"].abs().sum() > 0

        assert_only_model_tokens_get_gradient(trainer, policy, batch)

        assert len(sampler.pushed) == 1  # the policy, before the first turn
        trainer.train()  # one step through the stage: episodes, loss, update
        assert len(sampler.pushed) == 1  # the step sampled before any weight changed
        method.engine.generate([rows[0]["prompt_input_ids"]], 2)
        assert len(sampler.pushed) == 2  # the trained weights, pushed before sampling
        trained = policy.state_dict()
        assert any(not torch.equal(sampler.pushed[0][k], trained[k]) for k in trained)
        assert all(torch.equal(sampler.pushed[1][k], v) for k, v in trained.items())
    finally:
        trainer.close()
