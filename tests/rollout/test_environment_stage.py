"""GRPO on multi-turn episodes through the trainer's rollout stage: the method's ``tools`` /
``environment`` settings make the stage play episodes, and the training batch trains only the
model's own tokens while the policy attends to every token of the episode.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from tests.helpers.episodes import Narrator, ShortTurns, episode_trainer, one_episode_batch

from grimoire.cli.schema import validate_config
from grimoire.collate.prompts import GRPOCollator
from grimoire.errors import ConfigError
from grimoire.forward.completions import position_ids_from_mask
from grimoire.losses.grpo import GRPOMethod
from grimoire.losses.raft import RAFTMethod
from grimoire.losses.rloo import RLOOMethod
from grimoire.model.tiny import lookup
from grimoire.rollout.agents.environment import Step
from grimoire.rollout.batches import pack_rollout_batch
from grimoire.rollout.engines.base import Samples
from grimoire.rows.prompts import tokenize_grpo


def length_reward(prompts, completions, **kwargs):
    """Varies across a group, so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def _trainer(tiny_dir, tmp_path, padding_free=False, method_cls=GRPOMethod, **method_args):
    return episode_trainer(
        tiny_dir, tmp_path, [length_reward], padding_free, method_cls, **method_args
    )


_one_batch = one_episode_batch


def _naive_logps(model, batch):
    """Plain full-logits log-probs of every completion column ``[N, C]`` (no masking)."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    c = batch["completion_mask"].shape[1]
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)
    ).logits.float()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logps[:, -c:]


def test_environment_episodes_train_only_model_tokens_with_grpo(tiny_dir, tmp_path):
    trainer, rows = _trainer(tiny_dir, tmp_path, environment=Narrator)
    try:
        batch, metrics = _one_batch(trainer, rows)
        model, method = trainer.context.unwrapped_model, trainer.loss_fn
        mask = batch["completion_mask"]
        c = mask.shape[1]
        attended = batch["attention_mask"][:, -c:]
        context = (attended == 1) & (mask == 0)  # environment + template tokens after the prompt
        assert context.any(dim=1).all(), "every episode has environment tokens in its completion"
        assert ((mask == 1) & (attended == 0)).sum() == 0
        assert metrics["episode/turns_mean"] == 2.0
        assert batch["advantages"].abs().sum() > 0

        # Observe the gradient where the loss meets the model: the logits predicting each token.
        seen = {}
        head = model.get_output_embeddings()

        def keep(module, inputs, out):
            out.retain_grad()
            seen["logits"] = out

        hook = head.register_forward_hook(keep)
        model.zero_grad()
        loss, _ = method(model, batch)
        loss.backward()
        hook.remove()
        grad = seen["logits"].grad[:, -(c + 1) : -1]  # position before each completion column
        per_token = grad.abs().sum(-1)
        assert torch.all(per_token[context] == 0), "tool/environment tokens got a gradient"
        assert (per_token[mask.bool()] > 0).sum() > 0
        method_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

        # The naive reference: DAPO token mean of -A * ratio over the model's own tokens.
        model.zero_grad()
        logps = _naive_logps(model, batch)
        m = mask.float()
        ratio = torch.exp(logps - logps.detach())
        reference = (-batch["advantages"][:, None] * ratio * m).sum() / m.sum()
        reference.backward()
        ref_grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch.testing.assert_close(loss, reference, atol=1e-6, rtol=1e-5)
        for a, b in zip(method_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)

        # Per token: the method's log-probs are the naive ones on the model's tokens, 0 elsewhere;
        # the sampler's per-turn log-probs (the IS correction's) match them too.
        with torch.no_grad():
            mine, _ = method.policy_logps(model, batch)
            naive = _naive_logps(model, batch) * m
        torch.testing.assert_close(mine, naive, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch["sampler_logps"], naive, atol=1e-4, rtol=1e-4)
    finally:
        trainer.close()


def test_tools_episode_budget_is_group_times_episode_tokens(tiny_dir, tmp_path):
    method = GRPOMethod([length_reward], num_generations=4, tools=[lookup], max_episode_tokens=96)
    assert method.budget_tokens({"prompt_": 10}, packed=False) == 4 * 96
    assert method.agent is not None and method.agent.parser.__name__ == "parse_hermes"
    assert GRPOMethod([length_reward], num_generations=4).agent is None


def undocumented(word: str) -> str:
    return word


def test_tools_bad_specs_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError) as info:
        GRPOMethod(
            [length_reward],
            num_generations=2,
            tools=["grimoire.model.tiny:no_such_tool", undocumented],
            tool_call_parser="no_such_parser",
            max_turns=0,
        )
    text = str(info.value)
    assert "loss.args.tools[0]" in text and "no_such_tool" in text
    assert "tool_call_parser" in text and "no_such_parser" in text
    assert "max_turns" in text


def test_tools_undocumented_function_is_a_config_error():
    with pytest.raises(ConfigError, match=r"loss\.args\.tools\[0\]"):
        GRPOMethod([length_reward], num_generations=2, tools=[undocumented])


def test_environment_episode_batch_packed_gives_the_padded_loss(tiny_dir, tmp_path):
    trainer, rows = _trainer(tiny_dir, tmp_path, environment=Narrator)
    try:
        padded, _ = _one_batch(trainer, rows)
        packed = pack_rollout_batch(padded)
        assert "attention_mask" not in packed and packed["input_ids"].shape[0] == 1
        model, method = trainer.context.unwrapped_model, trainer.loss_fn
        grads = []
        losses = []
        for batch in (padded, packed):
            model.zero_grad()
            loss, _ = method(model, batch)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-5)
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    finally:
        trainer.close()


def test_tools_yaml_loss_args_mirror_the_method_arguments():
    loss = {
        "type": "grpo",
        "args": {
            "reward_funcs": ["exact_match"],
            "num_generations": 4,
            "tools": ["grimoire.model.tiny:lookup"],
            "tool_call_parser": "tiny",
            "stop_tokens": ["<|end|>"],
            "max_turns": 3,
            "max_episode_tokens": 128,
            "env_timeout": 5.0,
            "failure_reward": -1.0,
        },
    }
    raw = {"model": {"pretrained": "tiny:llama"}, "dataset": {"jsonl": "x.jsonl"}, "loss": loss}
    assert not [p for p in validate_config(raw) if "loss" in p]
    typo = {**loss, "args": {**loss["args"], "max_turn": 3}}
    assert any("max_turn" in p for p in validate_config({**raw, "loss": typo}))


def test_environment_evaluation_plays_one_greedy_episode_per_prompt(tiny_dir, tmp_path):
    trainer, rows = _trainer(tiny_dir, tmp_path, environment=Narrator)
    try:
        prompts = GRPOCollator(pad_token_id=trainer.tokenizer.pad_token_id)(rows[:2])
        loss, metrics = trainer.rollouts.evaluate(prompts)
        again, _ = trainer.rollouts.evaluate(prompts)
        assert metrics["episode/turns_mean"] == 2.0  # the environment's two turns, not one sample
        assert metrics["episode/turns"] == 4.0  # 2 prompts x 1 episode x 2 turns
        assert float(loss) == float(again)  # greedy: the same episodes
    finally:
        trainer.close()


class ReportingSampler(ShortTurns):
    """A sampler that reports its own log-prob of each token (as vLLM does): always -0.5."""

    def _sample(self, prompts, n, greedy):
        rows = super()._sample(prompts, n, greedy)
        return Samples(rows, [[-0.5] * len(r) for r in rows])


def test_environment_episodes_keep_sampler_and_old_logps_per_model_token(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    engine = ReportingSampler(max_new_tokens=8)
    engine.end_id = AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids("<|end|>")
    trainer, rows = _trainer(
        tiny_dir, tmp_path, environment=Narrator, engine=engine, num_iterations=2
    )
    try:
        batch, _ = _one_batch(trainer, rows)
        mask = batch["completion_mask"].float()
        # The sampler's log-probs on the model's tokens only; the policy's old log-probs scored
        # over the whole episode (tool results in context) equal the naive ones there.
        torch.testing.assert_close(batch["sampler_logps"], -0.5 * mask)
        with torch.no_grad():
            naive = _naive_logps(trainer.context.unwrapped_model, batch) * mask
        torch.testing.assert_close(batch["old_logps"], naive, atol=1e-5, rtol=1e-5)
    finally:
        trainer.close()


@pytest.mark.parametrize("method_cls", [RLOOMethod, RAFTMethod])
def test_environment_tokens_carry_no_gradient_in_rloo_and_raft(tiny_dir, tmp_path, method_cls):
    extra = {"beta": 0.0} if method_cls is RLOOMethod else {}
    trainer, rows = _trainer(
        tiny_dir, tmp_path, environment=Narrator, method_cls=method_cls, **extra
    )
    try:
        batch, _ = _one_batch(trainer, rows)
        model, method = trainer.context.unwrapped_model, trainer.loss_fn
        mask = batch["completion_mask"]
        c = mask.shape[1]
        context = (batch["attention_mask"][:, -c:] == 1) & (mask == 0)
        assert context.any()
        seen = {}

        def keep(module, inputs, out):
            out.retain_grad()
            seen["logits"] = out

        hook = model.get_output_embeddings().register_forward_hook(keep)
        loss, _ = method(model, batch)
        loss.backward()
        hook.remove()
        per_token = seen["logits"].grad[:, -(c + 1) : -1].abs().sum(-1)
        assert torch.all(per_token[context] == 0)
        assert (per_token[mask.bool()] > 0).any()
    finally:
        trainer.close()


class Recorder:
    """Keeps the row each episode starts from; ends the episode at once."""

    tools = None
    seen: ClassVar[list] = []

    def reset(self, row):
        Recorder.seen.append(row)
        prompt = row["prompt"]
        return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def step(self, message):
        return Step([], 0.0, True)


def test_a_chat_prompt_reaches_the_environment_as_its_messages(tiny_dir, tmp_path):
    """A chat-list prompt (system + a worked exchange + the question, as real datasets write
    them) is given to the environment as those messages, not as the rendered text (which the
    default environment would wrap into one user turn): the episode's first prompt is then the
    template's own rendering of the dataset's messages, token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse ab="},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "reverse cd="},
    ]
    trainer, _ = _trainer(tiny_dir, tmp_path, environment=Recorder)
    Recorder.seen = []
    try:
        rows = [tokenize_grpo({"prompt": messages, "answer": "dc"}, tok, max_length=64)] * 2
        batch, _ = _one_batch(trainer, rows)
        assert Recorder.seen and all(r["prompt"] == messages for r in Recorder.seen)
        assert all("prompt_messages" not in r and r["answer"] == "dc" for r in Recorder.seen)
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want = tok(rendered, add_special_tokens=False)["input_ids"]
        first = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
        assert first[: len(want)] == want
    finally:
        trainer.close()
