"""Reward functions see the whole episode: its final answer, messages, tool calls and the
environment's reward; a failed episode keeps its failure reward."""

from __future__ import annotations

from grimoire.model.tiny import build_tokenizer
from grimoire.rollout.agents.environment import Step, ToolEnvironment
from grimoire.rollout.agents.episode_batches import (
    episode_reward_inputs,
    final_answer,
    play_groups,
    score_episodes,
)
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episodes
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.rewards.scoring import resolve_reward_funcs

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|end|>")


def lookup(word: str) -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
    """
    return word[::-1]


class Graded(ToolEnvironment):
    """Pays 0.5 for the step that ends the episode; fails on a row asking it to."""

    def reset(self, row):
        self.fail = row.get("fail", False)
        return super().reset(row)

    def step(self, message):
        if self.fail:
            raise RuntimeError("broken")
        messages, _, done = super().step(message)
        return Step(messages, 0.5 if done else 0.0, done)


def used_the_tool(prompts, completions, tool_calls, **kwargs):
    return [float(any(turn for turn in calls)) for calls in tool_calls]


def play(turns_per_row, rows):
    """Episodes of ``rows`` in lockstep; each row's turns are scripted texts."""
    scripts = {
        row["prompt"]: [TOK(t, add_special_tokens=False)["input_ids"] + [END] for t in turns]
        for row, turns in zip(rows, turns_per_row)
    }

    def batch(prompts, max_new_tokens):
        out = []
        for p in prompts:
            text = TOK.decode(p)
            [key] = [k for k in scripts if k in text]
            sample = scripts[key].pop(0)
            out.append((sample, [-0.1] * len(sample)))
        return out

    envs = [Graded([lookup]) for _ in rows]
    limits = EpisodeLimits(failure_reward=-2.0)
    return run_episodes(rows, envs, batch, TOK, parse_tiny, limits, stop_token_ids=[END])


def test_environment_episode_rewards_see_answer_tool_calls_and_environment_reward():
    rows = [
        {"prompt": "reverse abc=", "answer": "cba"},
        {"prompt": "reverse abd=", "answer": "dba"},
        {"prompt": "reverse abe=", "answer": "eba", "fail": True},
    ]
    episodes = play(
        [["call: lookup(word=abc)", "cba"], ["dba"], ["call: lookup(word=abe)", "eba"]], rows
    )
    prompts, completions, columns = episode_reward_inputs(episodes, rows, TOK)
    assert completions == ["cba", "dba", ""]  # the failed episode's last turn was a call
    assert prompts[0].endswith("<|user|>reverse abc=<|end|><|assistant|>")
    assert columns["answer"] == ["cba", "dba", "eba"]
    assert columns["env_reward"] == [0.5, 0.5, -2.0]
    assert columns["episode_failed"] == [False, False, True]
    assert [m["role"] for m in columns["messages"][0]] == ["user", "assistant", "tool", "assistant"]
    funcs = resolve_reward_funcs(["exact_match", used_the_tool])
    total, per_func = score_episodes(funcs, episodes, rows, TOK)
    assert per_func["exact_match_reward"].tolist() == [1.0, 1.0, 0.0]
    assert per_func["used_the_tool"].tolist() == [1.0, 0.0, 1.0]
    # env 0.5 + exact 1 + tool 1; env 0.5 + exact 1; the failed episode: its failure reward.
    assert total.tolist() == [2.5, 1.5, -2.0]


def test_environment_groups_are_prompt_major_each_with_its_own_environment():
    rows = [
        {"prompt": "reverse abc=", "answer": "cba"},
        {"prompt": "reverse abd=", "answer": "dba"},
    ]
    made = []

    def factory():
        made.append(Graded([lookup]))
        return made[-1]

    def batch(prompts, max_new_tokens):
        out = []
        for p in prompts:
            text = TOK.decode(p)
            word = "abc" if "abc" in text else "abd"
            turn = word[::-1] if "result:" in text else f"call: lookup(word={word})"
            ids = TOK(turn, add_special_tokens=False)["input_ids"] + [END]
            out.append((ids, [-0.2] * len(ids)))
        return out

    episodes = play_groups(
        rows, factory, batch, TOK, parse_tiny, group_size=3, stop_token_ids=[END]
    )
    assert len(episodes) == 6 and len({id(e) for e in made}) == 6
    assert [final_answer(e) for e in episodes] == ["cba"] * 3 + ["dba"] * 3
    assert all(e.stop_reason == "done" and e.turns == 2 for e in episodes)
    assert [env.counters["tools/calls"] for env in made] == [1] * 6
