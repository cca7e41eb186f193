"""Tools as plain Python functions: their schemas (from signatures and docstrings, as the chat
templates take them) and running them so that nothing a tool does crashes the run."""

from __future__ import annotations

import json
import threading
from typing import Literal

import pytest

pytest.importorskip("trl")

from tests.helpers.chat_templates import char_tokenizer, template_dir

from grimoire.errors import ConfigError
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.toolbox import TOOL_OUTCOMES, build_tools, run_tool, tool_schema

NEVER = threading.Event()  # never set: a tool waiting on it never finishes


def lookup(word: str, times: int = 1, mode: Literal["fast", "slow"] = "fast") -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
        times: how many times to reverse it
        mode: how to look it up
    """
    return word[::-1] if times % 2 else word


def divide(a: float, b: float) -> float:
    """Divide two numbers.

    Args:
        a: the numerator
        b: the denominator
    """
    return a / b


def hang(x: str) -> str:
    """Never returns.

    Args:
        x: anything
    """
    NEVER.wait()
    return x


def as_dict(x: str) -> dict:
    """A dict.

    Args:
        x: a key
    """
    return {x: [1, 2]}


def as_object(x: str) -> object:
    """An object that is not JSON.

    Args:
        x: anything
    """
    return object()


def test_tools_schema_from_signature_and_docstring_is_the_chat_template_shape():
    expected = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The reverse of a word.",
            "parameters": {
                "type": "object",
                "properties": {
                    "word": {"type": "string", "description": "the word to look up"},
                    "times": {"type": "integer", "description": "how many times to reverse it"},
                    "mode": {
                        "type": "string",
                        "enum": ["fast", "slow"],
                        "description": "how to look it up",
                    },
                },
                "required": ["word"],
            },
            "return": {"type": "string"},
        },
    }
    assert tool_schema(lookup) == expected


def test_tools_schema_renders_as_transformers_renders_the_function_itself():
    # apply_chat_template(tools=[function]) builds the schema itself: the same text either way.
    tok = char_tokenizer((template_dir() / "qwen2_5.jinja").read_text())
    messages = [{"role": "user", "content": "reverse abc"}]
    ours = tok.apply_chat_template(messages, tools=[tool_schema(lookup)], tokenize=False)
    theirs = tok.apply_chat_template(messages, tools=[lookup], tokenize=False)
    assert ours == theirs
    assert '"name": "lookup"' in ours


def test_tools_without_docstring_or_hints_are_one_config_error_naming_each():
    def nodoc(x: int) -> int:
        return x

    def nohint(x):
        """Something.

        Args:
            x: a value
        """

    with pytest.raises(ConfigError) as info:
        build_tools([lookup, nodoc, nohint, "notafunction", lookup])
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith("tools[1]: tool 'nodoc'") and "no docstring" in problems[0]
    assert problems[1].startswith("tools[2]: tool 'nohint'") and "type hint" in problems[1]
    assert problems[2] == "tools[3]: 'notafunction' is not a function"
    assert "tools[4]: a second tool named 'lookup'" in problems[3]


def test_tools_run_returns_the_result_and_ok():
    tools = build_tools([lookup])
    result = run_tool(tools, "lookup", {"word": "abc"}, timeout=5)
    assert (result.content, result.outcome, result.ok) == ("cba", "ok", True)


def test_tools_exception_becomes_the_tools_error_message():
    result = run_tool(build_tools([divide]), "divide", {"a": 1, "b": 0}, timeout=5)
    assert result.outcome == "exception"
    assert result.content == "error: ZeroDivisionError: division by zero"


def test_tools_that_never_finish_time_out_into_an_error_message():
    result = run_tool(build_tools([hang]), "hang", {"x": "a"}, timeout=0.2)
    assert result.outcome == "timeout"
    assert result.content == "error: hang did not finish within 0.2s"


def test_tools_non_string_results_are_converted_or_reported():
    tools = build_tools([divide, as_dict, as_object])
    number = run_tool(tools, "divide", {"a": 3, "b": 2}, timeout=5)
    assert (number.content, number.outcome) == ("1.5", "converted")
    mapping = run_tool(tools, "as_dict", {"x": "k"}, timeout=None)
    assert json.loads(mapping.content) == {"k": [1, 2]} and mapping.outcome == "converted"
    bad = run_tool(tools, "as_object", {"x": "k"}, timeout=5)
    assert bad.outcome == "non_string" and not bad.ok
    assert bad.content == "error: the tool returned a object, not a string"


def test_tools_unknown_name_or_bad_arguments_are_error_messages():
    tools = build_tools([lookup, divide])
    unknown = run_tool(tools, "search", {}, timeout=5)
    assert unknown.outcome == "unknown_tool"
    assert unknown.content == "error: no tool named 'search' (tools: divide, lookup)"
    missing = run_tool(tools, "lookup", {"times": 2}, timeout=5)
    assert (
        missing.outcome == "bad_arguments"
        and "missing a required argument: 'word'" in missing.content
    )
    extra = run_tool(tools, "lookup", {"word": "a", "colour": "red"}, timeout=5)
    assert (
        extra.outcome == "bad_arguments" and "unexpected keyword argument 'colour'" in extra.content
    )


def test_tools_environment_answers_each_call_and_counts_every_outcome():
    env = ToolEnvironment([lookup, divide, hang], timeout=0.2)
    assert [t["function"]["name"] for t in env.tools] == ["lookup", "divide", "hang"]
    calls = [
        {"type": "function", "function": {"name": "lookup", "arguments": {"word": "abc"}}},
        {"type": "function", "function": {"name": "divide", "arguments": {"a": 1, "b": 0}}},
        {"type": "function", "function": {"name": "hang", "arguments": {"x": "y"}}},
        {"type": "function", "function": {"name": "nope", "arguments": {}}},
    ]
    messages, reward, done = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    assert (reward, done) == (0.0, False)
    assert [m["role"] for m in messages] == ["tool"] * 4
    assert [m["name"] for m in messages] == ["lookup", "divide", "hang", "nope"]
    assert messages[0]["content"] == "cba"
    assert all(m["content"].startswith("error: ") for m in messages[1:])
    assert env.counters == {
        "tools/calls": 4,
        "tools/ok": 1,
        "tools/exception": 1,
        "tools/timeout": 1,
        "tools/unknown_tool": 1,
    }
    assert set(env.counters) - {"tools/calls"} <= {f"tools/{o}" for o in TOOL_OUTCOMES}
    # A turn without calls ends the episode.
    assert env.step({"role": "assistant", "content": "cba"}) == ([], 0.0, True)


def test_tools_environment_cuts_long_outputs_and_counts_them():
    env = ToolEnvironment([lookup], max_output_chars=4)
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "abcdefgh"}}}
    messages, _, _ = env.step({"role": "assistant", "content": "", "tool_calls": [call, call]})
    assert [m["content"] for m in messages] == ["hgfe... (4 characters cut)"] * 2
    assert env.counters == {"tools/calls": 2, "tools/ok": 2, "tools/output_cut": 2}
    with pytest.raises(ValueError, match="max_output_chars must be > 0"):
        ToolEnvironment([lookup], max_output_chars=0)
