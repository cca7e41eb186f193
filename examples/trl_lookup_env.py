"""An environment written to TRL's ``environment_factory`` interface, nothing of grimoire's in it.

``examples/trl_environment_factory.yaml`` names it (``environment_factory:
trl_lookup_env:ReverseLookupEnv``; the config's folder is on the import path). The same class
runs unchanged with TRL: ``GRPOTrainer(..., environment_factory=ReverseLookupEnv)``.
"""

from __future__ import annotations


class ReverseLookupEnv:
    """The reverse task with a ``lookup`` tool; rewards looking up the prompt's own word."""

    def __init__(self):
        self.word = ""
        self.looked_up: list[str] = []

    def reset(self, **kwargs) -> str | None:
        # Every column of the row, as TRL passes them: "prompt" ("reverse abc=") and "answer".
        self.word = kwargs["answer"][::-1]
        self.looked_up = []
        # None keeps the prompt as the dataset wrote it (what the warm model was trained on); a
        # string would be appended to its last message.
        return None

    def lookup(self, word: str) -> str:
        """The reverse of a word.

        Args:
            word: the word to look up
        """
        self.looked_up.append(word)
        return word[::-1]

    def get_reward(self) -> float:
        """Half a point for looking up the prompt's word (the reward functions add theirs)."""
        return 0.5 if self.word in self.looked_up else 0.0
