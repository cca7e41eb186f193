"""The tiny tool task (``grimoire.model.tiny``): reverse a word by calling ``lookup``. Its SFT
rows train the call and the answer; a policy that uses the tool scores 1, one that does not, 0."""

from __future__ import annotations

import re

from grimoire.columns import IGNORE_INDEX
from grimoire.model.tiny import (
    LOOKUP_SCHEMA,
    build_tokenizer,
    lookup,
    lookup_chat_rows,
    reverse_rows,
)
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.episode_batches import score_episodes
from grimoire.rollout.agents.episodes import run_episodes
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.agents.toolbox import tool_schema
from grimoire.rollout.rewards.scoring import resolve_reward_funcs
from grimoire.rows.sft import tokenize_sft

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|end|>")


def test_tools_lookup_schema_is_the_one_built_from_the_function():
    assert tool_schema(lookup) == LOOKUP_SCHEMA


def test_tools_lookup_task_sft_rows_train_the_call_and_the_answer():
    rows = lookup_chat_rows(200, seed=0)
    # Palindromes among them: the tool's answer repeats the call's argument.
    assert any(r["messages"][2]["content"] in r["messages"][0]["content"] for r in rows)
    for row in rows:
        word = row["messages"][0]["content"][len("reverse ") : -1]
        out = tokenize_sft(row, TOK, 128)
        trained = [t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE_INDEX]
        # The template closes the final turn with <|end|>: no EOS after it (issue 44).
        expected = f"call: lookup(word={word})<|end|>{word[::-1]}<|end|>"
        assert TOK.decode(trained) == expected


def sampler(uses_tool: bool):
    """A scripted policy: calls lookup on the word and copies the result, or answers the word
    as it is without a call."""

    def generate_batch(prompts, max_new_tokens):
        out = []
        for p in prompts:
            text = TOK.decode(p)
            result = re.findall(r"result: ([a-z]*)<\|end\|>", text)
            word = re.findall(r"reverse ([a-z]+)=", text)[-1]
            if not uses_tool:
                turn = word
            else:
                turn = result[-1] if result else f"call: lookup(word={word})"
            ids = TOK(turn, add_special_tokens=False)["input_ids"] + [END]
            out.append((ids, [-0.3] * len(ids)))
        return out

    return generate_batch


def test_environment_lookup_task_rewards_the_policy_that_uses_the_tool():
    rows = reverse_rows(8, seed=1)
    funcs = resolve_reward_funcs(["exact_match"])
    scores = {}
    for uses_tool in (True, False):
        envs = [ToolEnvironment([lookup]) for _ in rows]
        eps = run_episodes(rows, envs, sampler(uses_tool), TOK, parse_tiny, stop_token_ids=[END])
        total, _ = score_episodes(funcs, eps, rows, TOK)
        scores[uses_tool] = total.tolist()
        assert all(e.stop_reason == "done" for e in eps)
    palindromes = [float(r["answer"] == r["answer"][::-1]) for r in rows]
    assert scores[True] == [1.0] * len(rows)
    assert scores[False] == palindromes  # without the tool only a palindrome is right
