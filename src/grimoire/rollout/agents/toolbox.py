"""Tools for multi-turn rollouts: plain Python functions, their JSON schemas, and running them
so that nothing a tool does can crash the run.

A tool is any function with type hints and a Google-style docstring (an ``Args:`` section
describing every argument)::

    def lookup(word: str) -> str:
        '''The reverse of a word.

        Args:
            word: the word to look up
        '''

Its schema is the OpenAI / Hugging Face shape ``{"type": "function", "function": {"name",
"description", "parameters"}}`` that ``tokenizer.apply_chat_template(tools=...)`` takes. The
schema comes from ``transformers.utils.get_json_schema``: it is the function transformers itself
applies when a chat template is given Python functions as ``tools``, so the schema grimoire
hands the template is the one the template's authors tested against (types from hints,
``Optional`` as nullable, ``Literal`` / ``choices`` as enums, descriptions from the docstring).
Its errors (no docstring, an undocumented argument, a missing hint) are collected for every
tool into one :class:`~grimoire.errors.ConfigError` naming the tool and the fix.

:func:`run_tool` calls a tool on parsed arguments with a timeout. A tool that raises, never
finishes, is called with arguments that do not fit its signature, or returns something that is
not a string becomes a message to the model (``"error: ..."``), never an exception, and the
outcome is counted (``tools/...`` metric names, :data:`TOOL_OUTCOMES`).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from grimoire.errors import ConfigError

#: How a tool call ended; each is counted as ``tools/<outcome>``.
TOOL_OUTCOMES: tuple[str, ...] = (
    "ok",
    "converted",  # returned a JSON-serialisable non-string: sent as its JSON text
    "unknown_tool",
    "bad_arguments",
    "exception",
    "timeout",
    "non_string",  # returned something that is neither a string nor JSON-serialisable
)


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the schema the chat template shows it."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The chat-template schema of ``function`` (``transformers.utils.get_json_schema``).

    Raises :class:`ConfigError` naming the function and what to add to it.
    """
    from transformers.utils.chat_template_utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # DocstringParsingException / TypeHintParsingException / ...
        name = getattr(function, "__name__", repr(function))
        raise ConfigError(
            [
                f"tool {name!r}: {exc}. A tool needs type hints on every argument and a "
                "Google-style docstring: a description line, then an 'Args:' section with "
                "'name: description' for each argument"
            ]
        ) from exc


def build_tools(functions: Iterable[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """``name -> Tool`` for a list of functions; every problem (a schema that cannot be built, a
    name used twice, something not callable) in one :class:`ConfigError`."""
    tools: dict[str, Tool] = {}
    problems: list[str] = []
    for i, fn in enumerate(functions):
        if isinstance(fn, Tool):
            tool = fn
        elif not callable(fn):
            problems.append(f"tools[{i}]: {fn!r} is not a function")
            continue
        else:
            try:
                schema = tool_schema(fn)
            except ConfigError as exc:
                problems.extend(f"tools[{i}]: {p}" for p in exc.problems)
                continue
            tool = Tool(schema["function"]["name"], fn, schema)
        if tool.name in tools:
            problems.append(f"tools[{i}]: a second tool named {tool.name!r}; names must differ")
            continue
        tools[tool.name] = tool
    if problems:
        raise ConfigError(problems)
    return tools


class _Timeout:
    """The marker :func:`call_with_timeout` returns for a call that did not finish in time."""


TIMEOUT = _Timeout()


def call_with_timeout(fn: Callable[..., Any], timeout: float | None, /, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, or :data:`TIMEOUT` when it has not returned after ``timeout``
    seconds (``None``: wait for ever). Its exception is re-raised here.

    The call runs in a daemon thread: Python cannot kill a thread, so a call that never returns
    keeps its thread (it does not hold up the process's exit) and the run goes on without it.
    Tools that may hang for good should stop themselves (a subprocess with its own timeout).
    """
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"grimoire-call-{fn!r:.40}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return TIMEOUT
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave the model (``content``) and how it ended (``outcome``)."""

    name: str
    content: str
    outcome: str

    @property
    def ok(self) -> bool:
        return self.outcome in ("ok", "converted")


def _as_text(value: Any) -> tuple[str, str]:
    if isinstance(value, str):
        return value, "ok"
    try:
        return json.dumps(value, ensure_ascii=False), "converted"
    except (TypeError, ValueError):
        return (
            f"error: the tool returned a {type(value).__name__}, not a string",
            "non_string",
        )


def run_tool(
    tools: Mapping[str, Tool], name: str, arguments: Mapping[str, Any], timeout: float | None
) -> ToolResult:
    """Call tool ``name`` with ``arguments``; see the module docstring for what never raises."""
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(name, f"error: no tool named {name!r} (tools: {known})", "unknown_tool")
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as exc:
        return ToolResult(name, f"error: bad arguments for {name}: {exc}", "bad_arguments")
    try:
        value = call_with_timeout(tool.function, timeout, **arguments)
    except Exception as exc:
        return ToolResult(name, f"error: {type(exc).__name__}: {exc}", "exception")
    if value is TIMEOUT:
        return ToolResult(name, f"error: {name} did not finish within {timeout}s", "timeout")
    content, outcome = _as_text(value)
    return ToolResult(name, content, outcome)


__all__ = [
    "TIMEOUT",
    "TOOL_OUTCOMES",
    "Tool",
    "ToolResult",
    "build_tools",
    "call_with_timeout",
    "run_tool",
    "tool_schema",
]
