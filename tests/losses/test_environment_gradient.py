"""Tool outputs and environment messages are context, never targets: a GRPO-style loss over an
episode's ``completion_mask`` gives them exactly zero gradient, while the model's tokens after
them still read them."""

from __future__ import annotations

import pytest
import torch

from grimoire.forward.completions import completion_logps
from grimoire.losses.online_functional import clipped_surrogate, reduce_token_loss
from grimoire.model.tiny import build_model, build_tokenizer
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.episode_batches import pad_episodes
from grimoire.rollout.agents.episodes import run_episode
from grimoire.rollout.agents.tool_parsers import parse_tiny

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|end|>")


def lookup(word: str) -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
    """
    return word[::-1]


def scripted(*turns: str):
    samples = [TOK(t, add_special_tokens=False)["input_ids"] + [END] for t in turns]

    def generate(prompt_ids, max_new_tokens):
        sample = samples.pop(0)
        return sample, [-0.7] * len(sample)

    return generate


def episodes():
    rows = [("reverse abc=", "abc", "cba"), ("reverse hello=", "hello", "olleh")]
    return [
        run_episode(
            {"prompt": prompt},
            ToolEnvironment([lookup]),
            scripted(f"call: lookup(word={word})", answer),
            TOK,
            parse_tiny,
            stop_token_ids=[END],
        )
        for prompt, word, answer in rows
    ]


@pytest.mark.usefixtures("one_thread")
def test_tools_and_environment_tokens_carry_no_gradient():
    eps = episodes()
    assert [e.stop_reason for e in eps] == ["done", "done"]
    batch = pad_episodes(eps, TOK.pad_token_id)
    mask = batch["completion_mask"]
    attention = batch["attention_mask"][:, -mask.shape[1] :]
    # The tool's turn sits inside the completion, attended (1) but not trained (0).
    context = (attention == 1) & (mask == 0)
    assert context.sum(-1).min() > 0
    model = build_model(vocab_size=len(TOK) + 8 - len(TOK) % 8, seed=1)
    logps, _ = completion_logps(model, batch["input_ids"], batch["attention_mask"], mask.shape[1])
    logps.retain_grad()
    advantages = torch.tensor([1.0, -0.5])
    per_token, _ = clipped_surrogate(logps, logps.detach(), advantages)
    loss = reduce_token_loss(per_token, mask, "dapo")
    loss.backward()
    grad = logps.grad
    assert (grad[mask == 0] == 0).all()  # exactly: tool, environment, template and padding
    # On the model's tokens: d/dlogp of -ratio * A / sum(M) at ratio 1 (a hand-worked reference).
    expected = -advantages.unsqueeze(1).expand_as(grad)[mask == 1] / mask.sum()
    torch.testing.assert_close(grad[mask == 1], expected)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.usefixtures("one_thread")
def test_tools_output_is_context_for_the_model_tokens_after_it():
    # The same episode with another tool result: the answer's log-probs change (the model reads
    # the tool's tokens), the call's log-probs before it do not.
    first, second = episodes()[0], episodes()[0]
    at = first.input_ids.index(TOK.convert_tokens_to_ids("c"), first.prompt_length + 25)
    assert first.completion_mask[at] == 0  # a token of the tool's result "cba"
    second.input_ids[at] = TOK.convert_tokens_to_ids("k")
    batch = pad_episodes([first, second], TOK.pad_token_id)
    model = build_model(vocab_size=len(TOK) + 8 - len(TOK) % 8, seed=1).eval()
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _ = completion_logps(model, batch["input_ids"], batch["attention_mask"], width)
    mask = batch["completion_mask"][0].bool()
    cut = at - first.prompt_length
    before, after = mask.clone(), mask.clone()
    before[cut:], after[:cut] = False, False
    torch.testing.assert_close(logps[0][before], logps[1][before])
    assert not torch.allclose(logps[0][after], logps[1][after])
