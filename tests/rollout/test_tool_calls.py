"""Tool-call parsers against what the stock chat templates (TRL's, read from the installed
package) write for an assistant turn with ``tool_calls``: each parser recovers exactly the calls
the template was given, from the rendered text of the turn alone."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.helpers.chat_templates import TOOLS, char_tokenizer, template_dir

from grimoire.errors import ConfigError
from grimoire.model.tiny import build_tokenizer
from grimoire.rollout.agents.tool_parsers import (
    ParsedTurn,
    ToolCall,
    parse_hermes,
    parse_llama3_json,
    parse_pythonic,
    parse_qwen3_coder,
    parse_tiny,
    resolve_tool_call_parser,
)

WEATHER = ToolCall("getweather", {"city": "zurichcity"})
TIME = ToolCall("gettime", {"zone": "utc", "hours": 3, "exact": True, "tags": ["a", "b"]})
NESTED = ToolCall("search", {"query": "x y", "filters": {"lang": "en", "max": 2}, "none": None})


def rendered_turn(template: str, calls: list[ToolCall], content: str = "") -> tuple[str, str]:
    """``(the text the template writes for the assistant turn, the turn-closing token)``: the
    rendering with the turn minus the rendering up to its generation prompt."""
    tok = char_tokenizer((template_dir() / f"{template}.jinja").read_text())
    user = [{"role": "user", "content": "userquestion"}]
    turn = {
        "role": "assistant",
        "content": content,
        "tool_calls": [c.as_message_call() for c in calls],
    }
    prompt = tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [turn], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    text = full[len(prompt) :]
    closing = "<|eot_id|>" if template.startswith("llama") else "<|im_end|>"
    return text[: text.rindex(closing)], closing


@pytest.mark.parametrize(
    "template", ["qwen2_5", "qwen2_5_training", "qwen3", "qwen3_instruct_2507", "qwen3_vl"]
)
@pytest.mark.parametrize("calls", [[WEATHER], [WEATHER, TIME, NESTED]], ids=["one", "three"])
def test_tool_call_hermes_parser_recovers_the_calls_qwen_templates_render(template, calls):
    text, _ = rendered_turn(template, calls)
    parsed = parse_hermes(text)
    assert parsed.errors == []
    assert parsed.tool_calls == calls
    assert "<tool_call>" not in parsed.content


def test_tool_call_hermes_parser_keeps_the_content_around_the_calls():
    text, _ = rendered_turn("qwen2_5", [WEATHER, TIME], content="let me check")
    parsed = parse_hermes(text)
    assert parsed.content == "let me check"
    assert parsed.tool_calls == [WEATHER, TIME]


@pytest.mark.parametrize("template", ["llama3_1", "llama3_2"])
@pytest.mark.parametrize("call", [WEATHER, TIME, NESTED], ids=["flat", "typed", "nested"])
def test_tool_call_llama3_json_parser_recovers_the_call_llama_templates_render(template, call):
    text, _ = rendered_turn(template, [call])
    assert text.startswith('{"name": ')  # the template writes the bare JSON object
    parsed = parse_llama3_json(text)
    assert parsed.errors == []
    assert parsed.tool_calls == [call]


def test_tool_call_llama3_json_parser_takes_the_python_tag_form_and_several_calls():
    parsed = parse_llama3_json(
        '<|python_tag|>{"name": "getweather", "parameters": {"city": "zurichcity"}}; '
        '{"name": "gettime", "arguments": {"zone": "utc", "hours": 3, "exact": true, '
        '"tags": ["a", "b"]}}'
    )
    assert parsed.errors == []
    assert parsed.tool_calls == [WEATHER, TIME]


def test_tool_call_llama3_json_parser_reads_plain_text_as_an_answer():
    parsed = parse_llama3_json("the weather is sunny")
    assert parsed == ParsedTurn("the weather is sunny", [], [])


@pytest.mark.parametrize("template", ["qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "qwen3_8"])
def test_tool_call_qwen3_coder_parser_recovers_the_calls_qwen3_5_templates_render(template):
    # String and integer arguments: qwen3_5 writes Python's True for a boolean (not JSON).
    calls = [WEATHER, ToolCall("gettime", {"zone": "utc", "hours": 3}), ToolCall("f", {})]
    text, _ = rendered_turn(template, calls)
    parsed = parse_qwen3_coder(text)
    assert parsed.errors == []
    assert parsed.tool_calls == calls


@pytest.mark.parametrize("template", ["lfm2_v2", "lfm2_2_5"])
def test_tool_call_pythonic_parser_recovers_the_calls_lfm2_templates_render(template):
    calls = [WEATHER, ToolCall("gettime", {"zone": "utc", "hours": 3})]
    text, _ = rendered_turn(template, calls, content="checking")
    parsed = parse_pythonic(text)
    assert parsed.errors == []
    assert parsed.tool_calls == calls
    assert parsed.content == "checking"


def test_tool_call_tiny_parser_recovers_the_calls_the_tiny_template_renders():
    tok = build_tokenizer()
    calls = [ToolCall("lookup", {"word": "abc"}), ToolCall("add", {"a": "1", "b": "2"})]
    turn = {"role": "assistant", "content": "", "tool_calls": [c.as_message_call() for c in calls]}
    text = tok.apply_chat_template([turn], tokenize=False)
    body = text[text.index("<|assistant|>") + len("<|assistant|>") : text.rindex("<|end|>")]
    assert body == "call: lookup(word=abc)call: add(a=1, b=2)"
    assert parse_tiny(body) == ParsedTurn("", calls, [])


@pytest.mark.parametrize(
    ("parser", "text", "error"),
    [
        (parse_hermes, "<tool_call>\n{not json}\n</tool_call>", "tool call 1: invalid JSON"),
        (parse_hermes, '<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        (parse_hermes, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
        (parse_hermes, '<tool_call>{"name": "f", "arguments": {', "never closed"),
        (parse_hermes, '<tool_call>{"name": "f", "arguments": "{x"}</tool_call>', "not JSON"),
        (parse_llama3_json, '{"name": "f", "parameters": {"a": ', "invalid JSON"),
        (parse_llama3_json, "<|python_tag|>getweather.call(city=1)", "no JSON object"),
        (parse_qwen3_coder, "<tool_call>\n<function=f>\n</tool_call>", "expected <function="),
        (parse_pythonic, "[getweather(city=open('x'))]", "not a literal"),
        (parse_pythonic, "<|tool_call_start|>[f(a=1)", "never closed"),
        (parse_pythonic, "[f(1)]", "is not name(key=value"),
        (parse_tiny, "call: lookup(word)", "not key=value"),
        (parse_tiny, "call: Lookup word", "'call:' that is not"),
    ],
)
def test_tool_call_parse_failure_is_a_result_not_an_exception(parser, text, error):
    parsed = parser(text)
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and error in parsed.errors[0], parsed.errors


def test_tool_call_parse_failure_of_one_call_keeps_the_others():
    parsed = parse_hermes(
        '<tool_call>{"name": "getweather", "arguments": {"city": "zurichcity"}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    assert parsed.tool_calls == [WEATHER]
    assert [e.split(":")[0] for e in parsed.errors] == ["tool call 2"]


def test_tool_call_hermes_parser_decodes_string_arguments_as_openai_sends_them():
    text = '<tool_call>{"name": "getweather", "arguments": "{\\"city\\": \\"zurichcity\\"}"}</tool_call>'
    assert parse_hermes(text).tool_calls == [WEATHER]


class UpperParser:
    """A user's parser class: ``NAME arg`` lines."""

    def parse(self, text: str) -> ParsedTurn:
        name, _, arg = text.partition(" ")
        return ParsedTurn("", [ToolCall(name.lower(), {"x": arg})])


def test_tool_call_parser_resolves_short_names_specs_classes_and_callables():
    assert resolve_tool_call_parser("hermes") is parse_hermes
    assert resolve_tool_call_parser("qwen") is parse_hermes
    assert resolve_tool_call_parser("grimoire.rollout.agents.tool_parsers:parse_tiny") is parse_tiny
    spec = resolve_tool_call_parser("tests.rollout.test_tool_calls:UpperParser")
    assert spec("LOOKUP abc").tool_calls == [ToolCall("lookup", {"x": "abc"})]
    assert resolve_tool_call_parser(parse_llama3_json) is parse_llama3_json


def test_tool_call_parser_unknown_name_is_a_config_error_naming_the_known_ones():
    with pytest.raises(
        ConfigError, match=r"unknown name 'hermess' \(did you mean \"hermes\"\?\); known: hermes, "
    ):
        resolve_tool_call_parser("hermess")


def test_tool_call_reasoning_before_the_calls_becomes_reasoning_content():
    parsed = parse_hermes(
        "<think>\nweather first\n</think>\n\n"
        '<tool_call>{"name": "getweather", "arguments": {"city": "zurichcity"}}</tool_call>'
    )
    message = parsed.as_message()
    assert message["reasoning_content"] == "weather first"
    assert message["content"] == ""
    assert message["tool_calls"] == [WEATHER.as_message_call()]
