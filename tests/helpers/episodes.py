"""Environments shared by the episode tests."""

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
