"""Tool-call parsers: the text of one sampled assistant turn -> its content and tool calls, in the
conventions the model families' chat templates write (and so the models are trained to emit).

===============  =================================================================================
name             what the assistant writes
===============  =================================================================================
``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn
                 (Qwen2.5, Qwen3, Hermes; alias ``qwen``)
``llama3_json``  one ``{"name": ..., "parameters": {...}}`` object, optionally after
                 ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3 custom tools)
``qwen3_coder``  ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
                 </tool_call>`` (Qwen3-Coder, Qwen3.5)
``pythonic``     ``[name(key=value, ...), ...]``, optionally between ``<|tool_call_start|>`` and
                 ``<|tool_call_end|>`` (LFM2; Llama 3.2 / 4's pythonic form); values are Python
                 literals, read with ``ast.literal_eval`` (never evaluated)
``tiny``         ``call: name(key=value, ...)`` (grimoire's tiny chat template,
                 :mod:`grimoire.model.tiny`)
===============  =================================================================================

A parser is any callable ``text -> ParsedTurn`` (or a class with a ``parse`` method); the
rollout names one by its short name or a ``package.module:Name`` spec
(:func:`resolve_tool_call_parser`, registry ``TOOL_CALL_PARSERS`` in
:mod:`grimoire.config.registry`). A malformed call (invalid JSON, no name, arguments that are
not an object, an unclosed tag) is never an exception: it is listed in
:attr:`ParsedTurn.errors`, which the episode counts as ``tool_calls/parse_errors``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from grimoire.config.registry import TOOL_CALL_PARSERS, resolve


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def as_message_call(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an assistant message, as chat templates read it."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """An assistant turn's text split into its content and its calls, with parse failures."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The assistant message for the conversation (``tool_calls`` only when there are)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if "</think>" in self.content:  # the templates take reasoning as its own field
            reasoning, _, answer = self.content.partition("</think>")
            message["content"] = answer.strip()
            message["reasoning_content"] = reasoning.replace("<think>", "").strip()
        if self.tool_calls:
            message["tool_calls"] = [c.as_message_call() for c in self.tool_calls]
        return message


ToolCallParser = Callable[[str], ParsedTurn]


def _call_from_object(obj: Any, where: str, args_keys: tuple[str, ...]) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded ``{"name", <args key>}`` object, or the problem."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: no 'name' string"
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models emit the arguments as a JSON string, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"{where}: arguments of {name!r} are a string that is not JSON"
    if not isinstance(args, dict):
        return f"{where}: arguments of {name!r} are a {type(args).__name__}, not an object"
    return ToolCall(name, args)


def _json_call(text: str, where: str, args_keys: tuple[str, ...]) -> ToolCall | str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"{where}: invalid JSON ({exc.msg} at char {exc.pos})"
    return _call_from_object(obj, where, args_keys)


def _tagged(text: str, body: Callable[[str, str], ToolCall | str]) -> ParsedTurn:
    """Every ``<tool_call>...</tool_call>`` block of ``text`` through ``body``; the rest is the
    content. An opening tag never closed (a turn cut by the token limit) is an error."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    content: list[str] = []
    pos = 0
    n = 0
    while True:
        start = text.find("<tool_call>", pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        n += 1
        end = text.find("</tool_call>", start)
        if end < 0:
            errors.append(f"tool call {n}: <tool_call> is never closed")
            break
        got = body(text[start + len("<tool_call>") : end].strip(), f"tool call {n}")
        (calls.append if isinstance(got, ToolCall) else errors.append)(got)  # type: ignore[arg-type]
        pos = end + len("</tool_call>")
    return ParsedTurn("".join(content).strip(), calls, errors)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""
    return _tagged(text, lambda body, where: _json_call(body, where, ("arguments", "parameters")))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_call(body: str, where: str) -> ToolCall | str:
    m = _FUNCTION.fullmatch(body.strip())
    if m is None:
        return f"{where}: expected <function=NAME>...</function>"
    args: dict[str, Any] = {}
    for key, raw in _PARAMETER.findall(m.group(2)):
        try:  # the template writes non-strings with tojson and strings as they are
            args[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            args[key.strip()] = raw
    return ToolCall(m.group(1).strip(), args)


def parse_qwen3_coder(text: str) -> ParsedTurn:
    """Qwen3-Coder / Qwen3.5: ``<tool_call><function=NAME><parameter=KEY>value</parameter>
    </function></tool_call>``; a value that reads as JSON is decoded, else kept as text."""
    return _tagged(text, _xml_call)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.x custom tools: the turn is ``{"name": ..., "parameters": {...}}`` (optionally
    after ``<|python_tag|>``; several objects may be separated by ``;``). Text that does not
    start with ``{`` is a plain answer; text that does and fails to parse is a parse error."""
    stripped = text.strip()
    tagged = stripped.startswith(_PYTHON_TAG)
    body = stripped[len(_PYTHON_TAG) :].strip() if tagged else stripped
    if not body.startswith("{"):
        if tagged:
            return ParsedTurn("", [], ["tool call 1: no JSON object after <|python_tag|>"])
        return ParsedTurn(stripped)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos, n = 0, 0
    while pos < len(body):
        n += 1
        where = f"tool call {n}"
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            errors.append(f"{where}: invalid JSON ({exc.msg} at char {exc.pos})")
            break
        got = _call_from_object(obj, where, ("parameters", "arguments"))
        (calls.append if isinstance(got, ToolCall) else errors.append)(got)  # type: ignore[arg-type]
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return ParsedTurn("", calls, errors)


_PYTHONIC_TAGS = ("<|tool_call_start|>", "<|tool_call_end|>")


def _pythonic_calls(source: str) -> list[ToolCall] | str:
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as exc:
        return f"not a Python list of calls ({exc.msg})"
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return f"{ast.unparse(node)[:60]!r} is not name(key=value, ...)"
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            return f"{ast.unparse(node)[:60]!r} has an argument that is not a literal"
        calls.append(ToolCall(node.func.id, args))
    return calls


def parse_pythonic(text: str) -> ParsedTurn:
    """LFM2 / Llama's pythonic calls: ``[name(key=value, ...), ...]`` (optionally between
    ``<|tool_call_start|>`` and ``<|tool_call_end|>``); the arguments must be literals. Text
    that does not start with ``[`` (after the opening tag) is a plain answer."""
    start, end = _PYTHONIC_TAGS
    content, tagged, rest = text.partition(start)
    if tagged:
        body, closed, after = rest.partition(end)
        if not closed:
            return ParsedTurn(content.strip(), [], [f"tool call 1: {start} is never closed"])
        content = content + after
    elif text.strip().startswith("["):
        body, content = text, ""
    else:
        return ParsedTurn(text.strip())
    calls = _pythonic_calls(body)
    if isinstance(calls, str):
        return ParsedTurn(content.strip(), [], [f"tool call 1: {calls}"])
    return ParsedTurn(content.strip(), calls)


_TINY_CALL = re.compile(r"call: ([a-z_][a-z0-9_]*)\(([^()]*)\)")


def parse_tiny(text: str) -> ParsedTurn:
    """The tiny template's ``call: name(key=value, ...)`` (values are kept as text: the tiny
    template writes them without quotes). A ``call:`` that does not match is an error."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for n, m in enumerate(_TINY_CALL.finditer(text), start=1):
        args: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in m.group(2).split(","))):
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                errors.append(f"tool call {n}: argument {part!r} is not key=value")
                break
            args[key.strip()] = value.strip()
        else:
            calls.append(ToolCall(m.group(1), args))
    content = _TINY_CALL.sub("", text)
    if "call:" in content:
        errors.append("a 'call:' that is not name(key=value, ...)")
    return ParsedTurn(content.strip(), calls, errors)


def resolve_tool_call_parser(parser: str | ToolCallParser | Any) -> ToolCallParser:
    """A parser from a short name (``TOOL_CALL_PARSERS``), a ``package.module:Name`` spec, a
    class with a ``parse`` method (instantiated without arguments), or a callable."""
    obj = (
        resolve(parser, TOOL_CALL_PARSERS, "tool_call_parser")
        if isinstance(parser, str)
        else parser
    )
    if isinstance(obj, type):
        obj = obj()
    parse = getattr(obj, "parse", obj)
    if not callable(parse):
        raise TypeError(f"tool_call_parser: {parser!r} is neither callable nor has .parse")
    return cast(ToolCallParser, parse)  # its result is checked per turn (a wrong type: an error)


__all__ = [
    "ParsedTurn",
    "ToolCall",
    "ToolCallParser",
    "parse_hermes",
    "parse_llama3_json",
    "parse_pythonic",
    "parse_qwen3_coder",
    "parse_tiny",
    "resolve_tool_call_parser",
]
