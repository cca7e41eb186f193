"""Environments and a reward shared by the episode tests."""

from __future__ import annotations

import torch

from grimoire.rollout.environment import Step


class Chatty:
    """Answers every turn with a user message; done after three turns, a reward per turn."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return Step([{"role": "user", "content": "again"}], 0.5, self.turns == 3)


class Narrator:
    """Answers every assistant turn with a tool message (context the model did not write) and
    ends the episode after the second turn: every episode has environment tokens between two
    sampled turns, whatever the (untrained) model writes."""

    tools = None

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        if self.turns >= 2:
            return Step([], 0.0, True)
        return Step([{"role": "tool", "content": "olleh dlrow"}], 0.0, False)


def answer_length(prompts, completions, **kwargs):
    """A reward that varies across a group (each answer's length), so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def assert_only_model_tokens_get_gradient(trainer, policy, batch) -> None:
    """One loss and backward on ``batch``, the gradient observed at the logits that predict
    each completion position (a forward hook on the output layer): exactly zero at every
    context token (tool results, environment and template tokens: attended, not in the loss
    mask), non-zero at some of the model's own tokens. The policy's gradients are cleared."""
    mask = batch["completion_mask"]
    c = mask.shape[1]
    context = (batch["attention_mask"][:, -c:] == 1) & (mask == 0)
    seen = {}

    def keep(module, inputs, out):
        out.retain_grad()
        seen["logits"] = out

    hook = policy.get_output_embeddings().register_forward_hook(keep)
    try:
        loss, _ = trainer.loss_fn(policy, batch)
        loss.backward()
    finally:
        hook.remove()
    policy.zero_grad()
    per_token = seen["logits"].grad[:, -(c + 1) : -1].abs().sum(-1)
    assert torch.all(per_token[context] == 0), "tool/template tokens got a gradient"
    assert (per_token[mask.bool()] > 0).any()
