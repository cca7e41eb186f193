"""TRL's ``environment_factory`` classes run unchanged: a class written to TRL's documented
interface (a constructor without arguments, ``reset(**row)`` returning text for the prompt,
public methods as tools documented by their docstrings, ``get_reward``) is given to
``GRPOMethod(environment_factory=...)`` or as a YAML spec as it is, and its episodes train only
the model's own tokens.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.episodes import (
    add_call,
    assert_only_model_tokens_get_gradient,
    assert_validates,
    episode_yaml,
    first_call_letters,
    grpo_advantages,
    one_episode_batch,
    scripted_call_trainer,
)

from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.rollout.agents.trl_environment import TRLEnvironment, trl_environment_factory


class CounterEnv:
    """Written to TRL's interface only (nothing of grimoire's): counts letters."""

    def __init__(self):
        self.total = 0
        self.row = {}

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        self.row = kwargs
        return " count letters."

    def add(self, letters: str) -> str:
        """Add the number of letters to the total.

        Args:
            letters: The letters to count.

        Returns:
            The new total.
        """
        self.total += len(letters)
        return str(self.total)

    def double(self) -> str:
        """Double the total.

        Returns:
            The new total.
        """
        self.total *= 2
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)

    def _helper(self) -> None:  # private: not a tool
        pass


#: The schemas written out by hand (TRL renders the same from ``get_json_schema``).
EXPECTED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add the number of letters to the total.",
            "parameters": {
                "type": "object",
                "properties": {
                    "letters": {"type": "string", "description": "The letters to count."}
                },
                "required": ["letters"],
            },
            "return": {"type": "string", "description": "The new total."},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "double",
            "description": "Double the total.",
            "parameters": {"type": "object", "properties": {}},
            "return": {"type": "string", "description": "The new total."},
        },
    },
]


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def call(name: str, **arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def test_environment_factory_tools_are_the_public_methods_with_docstring_schemas():
    from transformers.utils import get_json_schema

    env = trl_environment_factory(CounterEnv)()
    assert env.tools == EXPECTED_TOOLS
    # What TRL hands the chat template for the same class: the bound methods' schemas.
    probe = CounterEnv()
    assert env.tools == [get_json_schema(probe.add), get_json_schema(probe.double)]


def test_environment_factory_reset_gets_the_row_and_extends_the_last_message():
    env = trl_environment_factory(CounterEnv)()
    row = {"prompt": "reverse abc=", "answer": "cba"}
    assert env.reset(row) == [{"role": "user", "content": "reverse abc= count letters."}]
    assert env.instance.row == row  # every column, as keywords
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert env.reset({"prompt": chat}) == [
        chat[0],
        {"role": "user", "content": "hi count letters."},
    ]
    assert chat[1]["content"] == "hi"  # the row is left as it was
    # No prompt column: TRL's empty user turn, filled by reset.
    assert env.reset({"level": 3}) == [{"role": "user", "content": " count letters."}]


def test_environment_factory_episode_reward_is_get_reward_after_the_last_call():
    env = trl_environment_factory(CounterEnv)()
    env.reset({"prompt": "p"})
    steps = [
        env.step(call("add", letters="abc")),
        env.step(call("double")),
        env.step(call("add", letters="x")),
    ]
    assert [s.messages[0]["content"] for s in steps] == ["3", "6", "7"]
    assert [s.done for s in steps] == [False, False, False]
    last = env.step({"role": "assistant", "content": "seven"})
    assert last.done and last.messages == []
    assert sum(s.reward for s in [*steps, last]) == 7.0 == env.instance.get_reward()
    env.reset({"prompt": "p"})  # a new episode starts from the reset state's reward
    assert env.step(call("add", letters="ab")).reward == 2.0


def test_environment_factory_one_instance_per_episode():
    method = GRPOMethod([zero_reward], num_generations=2, environment_factory=CounterEnv)
    assert method.agent is not None
    first, second = method.agent.env_factory(), method.agent.env_factory()
    assert isinstance(first, TRLEnvironment) and isinstance(first.instance, CounterEnv)
    assert first.instance is not second.instance
    first.reset({"prompt": "p"})
    second.reset({"prompt": "q"})
    first.step(call("add", letters="abcd"))
    assert (first.instance.total, second.instance.total) == (4, 0)
    # Each episode's tools call its own instance's methods.
    assert second.step(call("add", letters="a")).messages[0]["content"] == "1"


class Flaky:
    def reset(self, **kwargs) -> None:
        return None

    def divide(self, a: str, b: str) -> str:
        """Divide a by b.

        Args:
            a: The numerator.
            b: The denominator.
        """
        return str(int(a) / int(b))


def test_environment_factory_tool_exception_is_a_tool_message():
    env = trl_environment_factory(Flaky)()
    assert env.reset({"prompt": "p"}) == [{"role": "user", "content": "p"}]
    step = env.step(call("divide", a="1", b="0"))
    assert step.messages == [
        {"role": "tool", "name": "divide", "content": "error: ZeroDivisionError: division by zero"}
    ]
    assert not step.done and step.reward == 0.0  # no get_reward: the reward functions score
    assert env.counters["tools/exception"] == 1


class NoReset:
    def look(self, word: str) -> str:
        """Look.

        Args:
            word: The word.
        """
        return word


class Undocumented:
    def reset(self, **kwargs):
        return None

    def look(self, word):
        return word


def test_environment_factory_malformed_classes_are_config_errors_naming_what_is_missing():
    with pytest.raises(ConfigError, match=r"environment_factory: NoReset has no reset method"):
        GRPOMethod([zero_reward], num_generations=2, environment_factory=NoReset)
    with pytest.raises(ConfigError, match=r"environment_factory: .* is not a class"):
        GRPOMethod([zero_reward], num_generations=2, environment_factory=CounterEnv())
    with pytest.raises(ConfigError, match=r"environment_factory: Undocumented.*look"):
        GRPOMethod([zero_reward], num_generations=2, environment_factory=Undocumented)
    with pytest.raises(ConfigError, match=r"environment or environment_factory"):
        GRPOMethod(
            [zero_reward], num_generations=2, environment=CounterEnv, environment_factory=CounterEnv
        )
    with pytest.raises(ConfigError, match=r"environment_factory: cannot import"):
        GRPOMethod([zero_reward], num_generations=2, environment_factory="no_such.module:Env")
    with pytest.raises(TypeError, match="environment_factories"):
        GRPOMethod([zero_reward], num_generations=2, environment_factories=CounterEnv)


def _yaml(tmp_path, factory: str) -> str:
    return episode_yaml(tmp_path, f"environment_factory: '{factory}'")


def test_environment_factory_yaml_spec_validates(tmp_path, capsys):
    good = _yaml(tmp_path, "tests.rollout.test_environment_factory:CounterEnv")
    bad = _yaml(tmp_path, "tests.rollout.test_environment_factory:NoReset")
    assert_validates(capsys, good, bad, "NoReset has no reset method")


def test_environment_factory_grpo_step_trains_only_model_tokens(tiny_dir, tmp_path):
    # The first turn of episode i adds 1 + i % 3 letters: the rewards vary in each group.
    trainer, rows, tok = scripted_call_trainer(
        tiny_dir,
        tmp_path,
        [zero_reward],
        add_call,
        environment_factory=CounterEnv,
    )
    try:
        batch, metrics = one_episode_batch(trainer, rows)
        # The tool's answer is read (attended) but never trained (mask 0).
        r = first_call_letters(batch, tok)
        assert metrics["episode/turns_mean"] == 2.0
        assert metrics["tools/calls"] == 8.0

        # get_reward (the letters added) is the reward; GRPO's group advantages by hand.
        torch.testing.assert_close(batch["advantages"].float().cpu(), grpo_advantages(r))

        assert_only_model_tokens_get_gradient(trainer, trainer.context.unwrapped_model, batch)
    finally:
        trainer.close()
