"""Prompt data of the online methods under grimoire-rl's module path (``grimoire.data.grpo``);
a facade."""

from grimoire.collate.prompts import GRPOCollator
from grimoire.rows.prompts import tokenize_grpo

__all__ = ["GRPOCollator", "tokenize_grpo"]
