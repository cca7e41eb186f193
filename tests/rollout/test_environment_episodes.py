"""Multi-turn episodes on the tiny tokenizer with a scripted ``generate``: the episode's token
ids, its mask of the model's own tokens, its limits, and environments that misbehave."""

from __future__ import annotations

import logging
import threading

import pytest

from grimoire.model.tiny import build_tokenizer
from grimoire.rollout.agents.environment import Step, ToolEnvironment
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episode, run_episodes, sum_metrics
from grimoire.rollout.agents.tool_parsers import parse_tiny

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|end|>")
NEVER = threading.Event()


def lookup(word: str) -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
    """
    return word[::-1]


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Script:
    """A ``generate`` that returns fixed turns (each ending in ``<|end|>``) with log-probs
    ``-(turn + 1) / 10 - position / 100``, and records the prompts it was given."""

    def __init__(self, *turns: str, stop: bool = True):
        self.turns = [ids(t) + ([END] if stop else []) for t in turns]
        self.prompts: list[list[int]] = []
        self.samples: list[list[int]] = []

    def logps(self, k: int, n: int) -> list[float]:
        return [-(k + 1) / 10 - i / 100 for i in range(n)]

    def __call__(self, prompt_ids: list[int], max_new_tokens: int):
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        sample = self.turns[k % len(self.turns)]
        self.samples.append(sample[:max_new_tokens])
        return sample, self.logps(k, len(sample))


def episode(script: Script, env=None, row=None, **limits):
    return run_episode(
        row or {"prompt": "reverse abc="},
        env or ToolEnvironment([lookup]),
        script,
        TOK,
        parse_tiny,
        EpisodeLimits(**limits),
        stop_token_ids=[END],
    )


def test_environment_episode_model_tokens_are_exactly_the_sampled_ids():
    script = Script("call: lookup(word=abc)", "cba")
    ep = episode(script)
    assert ep.stop_reason == "done" and ep.turns == 2
    assert ep.model_token_ids == script.samples[0] + script.samples[1]
    # Every other token is the template's: the episode decodes to the rendered conversation.
    rendered = TOK.apply_chat_template(ep.messages, tools=[lookup], tokenize=False)
    assert TOK.decode(ep.input_ids) == rendered
    assert rendered.endswith(
        "<|assistant|>call: lookup(word=abc)<|end|><|user|>result: cba<|end|><|assistant|>cba<|end|>"
    )
    # The mask: 0 on the prompt, 1 on each sample, 0 on the tool's turn and the next header.
    p = ep.prompt_length
    tail = len(ids("<|user|>result: cba<|end|><|assistant|>"))
    n0, n1 = len(script.samples[0]), len(script.samples[1])
    assert ep.completion_mask == [0] * p + [1] * n0 + [0] * tail + [1] * n1
    assert len(ep.input_ids) == p + n0 + tail + n1
    assert ep.sampler_logps == [0.0] * p + script.logps(0, n0) + [0.0] * tail + script.logps(1, n1)


def test_environment_episode_each_prompt_extends_the_last_prompt_and_its_sample():
    script = Script("call: lookup(word=abc)", "call: lookup(word=cba)", "abc")
    ep = episode(script)
    assert len(script.prompts) == 3 and ep.turns == 3
    for k in range(2):
        before = script.prompts[k] + script.samples[k]
        assert script.prompts[k + 1][: len(before)] == before
    assert ep.input_ids[: len(script.prompts[2])] == script.prompts[2]


def test_environment_episode_records_messages_tool_calls_and_rewards():
    class Graded(ToolEnvironment):
        def step(self, message):
            messages, _, done = super().step(message)
            return Step(messages, 0.25 if message.get("tool_calls") else 1.0, done)

    ep = episode(Script("call: lookup(word=abc)", "cba"), env=Graded([lookup]))
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2] == {"role": "tool", "name": "lookup", "content": "cba"}
    assert [[(c.name, c.arguments) for c in turn] for turn in ep.tool_calls] == [
        [("lookup", {"word": "abc"})],
        [],
    ]
    assert ep.env_rewards == [0.25, 1.0] and ep.reward == 1.25
    assert ep.metrics["tools/ok"] == 1 and ep.metrics["tool_calls/count"] == 1


def test_environment_episode_stops_at_max_turns():
    ep = episode(Script("call: lookup(word=abc)"), max_turns=3)
    assert (ep.stop_reason, ep.turns) == ("max_turns", 3)
    assert ep.metrics["tools/calls"] == 3
    # The last turn's tool result is in the messages (for rewards) but not in the tokens.
    assert ep.messages[-1]["role"] == "tool"
    assert ep.completion_mask[-1] == 1


def test_environment_episode_token_budget_bounds_every_token():
    script = Script("call: lookup(word=abc)")
    first = episode(Script("abc"))
    budget = first.prompt_length + 30
    ep = episode(script, max_tokens=budget)
    assert ep.stop_reason == "token_budget"
    assert len(ep.input_ids) <= budget
    # The sample was cut at the room left, which ends the turn unfinished... or the tool's
    # answer did not fit: either way nothing past the budget.
    assert all(len(p) + len(s) <= budget for p, s in zip(script.prompts, script.samples))


def test_environment_episode_truncated_turn_ends_without_stepping_the_environment():
    env = ToolEnvironment([lookup])
    ep = episode(Script("call: lookup(word=abc)", stop=False), env=env, max_new_tokens=8)
    assert ep.stop_reason == "truncated" and ep.turns == 1
    assert sum(ep.completion_mask) == 8
    assert env.counters == {}  # the unfinished call was never run


def test_tool_call_parse_failure_is_counted_and_the_episode_goes_on():
    ep = episode(Script("call: lookup(word)"))
    assert ep.stop_reason == "done"  # no call parsed: the tool environment ends the episode
    assert ep.metrics["tool_calls/parse_errors"] == 1
    assert ep.metrics["tool_calls/count"] == 0


def test_tool_call_parser_that_raises_is_a_parse_error_not_a_crash():
    def broken(text):
        raise IndexError("oops")

    ep = run_episode(
        {"prompt": "reverse abc="},
        ToolEnvironment([lookup]),
        Script("call: lookup(word=abc)"),
        TOK,
        broken,
        stop_token_ids=[END],
    )
    assert ep.stop_reason == "done" and ep.metrics["tool_calls/parse_errors"] == 1
    assert ep.messages[-1] == {"role": "assistant", "content": "call: lookup(word=abc)"}


class Raises(ToolEnvironment):
    def step(self, message):
        raise RuntimeError("boom")


class Hangs(ToolEnvironment):
    def step(self, message):
        NEVER.wait()


class BadTypes(ToolEnvironment):
    def step(self, message):
        return ("not a list", "1", "yes")


class ResetRaises(ToolEnvironment):
    def reset(self, row):
        raise KeyError("question")


@pytest.mark.parametrize(
    ("env_class", "failure"),
    [
        (Raises, "step exception: RuntimeError: boom"),
        (Hangs, "step timeout: did not return within 0.2s"),
        (
            BadTypes,
            "step bad_return: step returned str messages, not a list; reward is a str, not a "
            "number; done is a str, not a bool",
        ),
        (ResetRaises, "reset exception: KeyError: 'question'"),
    ],
)
def test_environment_failure_is_named_in_the_log_counted_and_ends_with_the_failure_reward(
    env_class, failure, caplog
):
    caplog.set_level(logging.WARNING, logger="grimoire.rollout.agents.episodes")
    ep = run_episode(
        {"prompt": "reverse abc="},
        env_class([lookup]),
        Script("call: lookup(word=abc)", "cba"),
        TOK,
        parse_tiny,
        EpisodeLimits(env_timeout=0.2, failure_reward=-1.0),
        stop_token_ids=[END],
        episode_id="row-7/g2",
    )
    assert ep.stop_reason == "environment_error"
    assert ep.failure == failure
    assert ep.reward == -1.0
    kind = failure.split()[1].rstrip(":")
    assert ep.metrics["environment/failures"] == 1
    assert ep.metrics[f"environment/failures/{kind}"] == 1
    [record] = caplog.records
    assert record.getMessage().startswith(
        f"episode row-7/g2: environment {env_class.__name__} failed"
    )
    assert "the episode ends with reward -1.0" in record.getMessage()


def test_environment_failure_default_reward_is_zero_and_other_episodes_go_on():
    class FailsOnSecond(ToolEnvironment):
        def step(self, message):
            if "fail" in str(self.row):
                raise ValueError("bad row")
            return super().step(message)

        def reset(self, row):
            self.row = row
            return super().reset(row)

    rows = [{"prompt": "reverse abc="}, {"prompt": "fail"}, {"prompt": "reverse abc="}]
    envs = [FailsOnSecond([lookup]) for _ in rows]
    script = Script("call: lookup(word=abc)", "cba")

    def batch(prompts, max_new_tokens):
        return [script(p, max_new_tokens) for p in prompts]

    episodes = run_episodes(rows, envs, batch, TOK, parse_tiny, stop_token_ids=[END])
    assert [e.stop_reason for e in episodes] == ["done", "environment_error", "done"]
    assert (
        episodes[1].reward == 0.0 and episodes[1].failure == "step exception: ValueError: bad row"
    )
    totals = sum_metrics(episodes)
    assert totals["environment/failures"] == 1
    assert totals["episode/stop/done"] == 2


def test_environment_episodes_in_lockstep_equal_episodes_one_by_one():
    rows = [{"prompt": "reverse abc="}, {"prompt": "reverse abcd="}]

    def scripted(prompt_ids, max_new_tokens):
        # Deterministic in the prompt: a call on the first turn, an answer after a tool result.
        text = TOK.decode(prompt_ids)
        turn = "cba" if "result:" in text else "call: lookup(word=abc)"
        sample = ids(turn) + [END]
        return sample, [-0.5] * len(sample)

    one_by_one = [
        run_episode(r, ToolEnvironment([lookup]), scripted, TOK, parse_tiny, stop_token_ids=[END])
        for r in rows
    ]
    calls = []

    def batch(prompts, max_new_tokens):
        calls.append(len(prompts))
        return [scripted(p, max_new_tokens) for p in prompts]

    lockstep = run_episodes(
        rows,
        [ToolEnvironment([lookup]) for _ in rows],
        batch,
        TOK,
        parse_tiny,
        stop_token_ids=[END],
    )
    assert calls == [2, 2]  # each sampling call took both episodes' turns
    for a, b in zip(one_by_one, lockstep):
        assert (a.input_ids, a.completion_mask, a.sampler_logps) == (
            b.input_ids,
            b.completion_mask,
            b.sampler_logps,
        )
        assert a.messages == b.messages
