"""Environments and a reward shared by the episode tests."""

from __future__ import annotations

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
