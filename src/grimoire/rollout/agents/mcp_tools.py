"""Tools served by MCP servers (``loss.args.mcp_servers``), as grimoire tools.

Each entry of ``mcp_servers`` is one server::

    {"command": ["python", "server.py"], "args": [...], "env": {...}, "cwd": "..."}  # stdio
    {"url": "http://127.0.0.1:8000/mcp", "headers": {...}}                          # HTTP
    # either may add "name" (a label for errors) and "tools" (the names to take)

:func:`parse_mcp_servers` checks them (every problem in one
:class:`~grimoire.errors.ConfigError` naming ``loss.args.mcp_servers[i].<key>``), and
:func:`connect_mcp_tools` starts or reaches every server, lists its tools and returns them as
:class:`~grimoire.rollout.agents.toolbox.Tool` s: the server's name and description, its
``inputSchema`` as the ``parameters`` of the chat template's function schema, and a function
that routes the call to that server (:class:`~grimoire.rollout.agents.mcp_bridge.McpBridge`).
This happens when the method is built, before any model is loaded, so a server that does not
start is a config error, not a failure at the first episode. The connections stay open for the
run; the :class:`McpToolset` closes them (the rollout stage's ``close``, or interpreter exit).

A call's text content is joined into the tool message. A result the server marks ``isError``
(the tool raised, the arguments did not validate), a server that exited or went away, and a
call with arguments outside the schema become ``error: ...`` tool messages, counted as
``tools/exception`` or ``tools/bad_arguments`` (:func:`~grimoire.rollout.agents.toolbox.run_tool`);
the environment's timeout (10 s) bounds every call.
"""

from __future__ import annotations

import inspect
import json
import keyword
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.errors import ConfigError
from grimoire.rollout.agents.mcp_bridge import McpBridge, McpServer, McpServerError, import_mcp
from grimoire.rollout.agents.toolbox import Tool

#: Seconds a server may take to start (or answer over HTTP) and list its tools.
START_TIMEOUT = 30.0
#: Seconds a request may wait for its answer: a backstop that frees an abandoned call (the
#: environment's own tool timeout, 10 s, is what the model waits).
CALL_TIMEOUT = 60.0
_KEYS = {"command", "args", "env", "cwd", "url", "headers", "name", "tools"}


class McpToolError(RuntimeError):
    """A tool's result marked ``isError`` by its server; the message is the result's text."""


def _strings(value: Any) -> bool:
    return (
        not isinstance(value, str)
        and isinstance(value, Sequence)
        and (all(isinstance(v, str) for v in value))
    )


def _string_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _server(entry: Any, where: str, problems: list[str]) -> McpServer | None:
    if isinstance(entry, McpServer):
        return entry
    if not isinstance(entry, Mapping):
        problems.append(f"{where}: a mapping with 'command' (stdio) or 'url' (HTTP), got {entry!r}")
        return None
    before = len(problems)
    problems.extend(
        f"{where}.{k}: unknown key (keys: {sorted(_KEYS)})" for k in entry if k not in _KEYS
    )
    command, url = entry.get("command"), entry.get("url")
    if (command is None) == (url is None):
        problems.append(f"{where}: give 'command' (a stdio server) or 'url' (HTTP), one of them")
    if url is not None:
        for key in ("args", "env", "cwd"):
            if key in entry:
                problems.append(f"{where}.{key}: only for a stdio server ('command')")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            problems.append(f"{where}.url: an http:// or https:// URL, got {url!r}")
    if command is not None:
        command = [command] if isinstance(command, str) else command
        if not _strings(command) or not command:
            problems.append(f"{where}.command: a program and its arguments, got {command!r}")
        if "headers" in entry:
            problems.append(f"{where}.headers: only for an HTTP server ('url')")
    checks = {
        "args": (_strings, "a list of strings"),
        "env": (_string_map, "a mapping of names to strings"),
        "headers": (_string_map, "a mapping of names to strings"),
        "cwd": (lambda v: isinstance(v, str), "a folder"),
        "name": (lambda v: isinstance(v, str) and v, "a non-empty string"),
        "tools": (lambda v: _strings(v) and v, "a non-empty list of tool names"),
    }
    for key, (ok, what) in checks.items():
        if key in entry and not ok(entry[key]):
            problems.append(f"{where}.{key}: {what}, got {entry[key]!r}")
    if len(problems) > before:
        return None
    argv = tuple(command or ()) + tuple(entry.get("args") or ())
    label = entry.get("name") or url or " ".join(argv)
    if argv and argv[0] in ("python", "python3"):  # the server runs in this run's interpreter
        argv = (sys.executable, *argv[1:])
    tools = entry.get("tools")
    return McpServer(
        label=repr(label),
        command=argv,
        env=entry.get("env"),
        cwd=entry.get("cwd"),
        url=url,
        headers=entry.get("headers"),
        tools=None if tools is None else tuple(tools),
    )


def parse_mcp_servers(value: Any, where: str = "loss.args.mcp_servers") -> list[McpServer]:
    """The servers of ``value`` (a list of mappings, one mapping, or :class:`McpServer` s),
    every problem in one :class:`ConfigError`; also when the ``mcp`` package is missing."""
    try:
        import_mcp()
    except ImportError as exc:
        raise ConfigError([f"{where}: {exc}"]) from exc
    entries = [value] if isinstance(value, Mapping | McpServer) else value
    if isinstance(entries, str) or not isinstance(entries, Sequence):
        raise ConfigError([f"{where}: a list of servers, got {value!r}"])
    problems: list[str] = []
    servers = [_server(e, f"{where}[{i}]", problems) for i, e in enumerate(entries)]
    if problems:
        raise ConfigError(problems)
    return [s for s in servers if s is not None]


def _signature(schema: Mapping[str, Any]) -> inspect.Signature | None:
    """The keyword-only signature of an ``inputSchema`` (required properties without a
    default), so a call with a missing or unknown argument is ``bad_arguments`` before it is
    sent; None when the names are not Python identifiers or extra properties are allowed."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    names = list(properties)
    if schema.get("additionalProperties") not in (None, False) or not all(
        n.isidentifier() and not keyword.iskeyword(n) for n in names
    ):
        return None
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter(n, kind)
            if n in required
            else inspect.Parameter(n, kind, default=None)
            for n in sorted(names, key=lambda n: n not in required)
        ]
    )


def result_text(result: Any) -> str:
    """The tool message of a ``CallToolResult``: its text parts joined by newlines (an
    embedded text resource's text; other parts as a ``[image: image/png]`` placeholder), or
    its ``structuredContent`` as JSON when it has no content."""
    parts = []
    for part in result.content or ():
        if getattr(part, "type", None) == "text":
            parts.append(part.text)
        elif isinstance(getattr(getattr(part, "resource", None), "text", None), str):
            parts.append(part.resource.text)
        else:
            mime = getattr(part, "mimeType", None) or getattr(part, "uri", "")
            parts.append(f"[{getattr(part, 'type', 'content')}: {mime}]")
    if not parts and result.structuredContent is not None:
        return json.dumps(result.structuredContent, ensure_ascii=False)
    return "\n".join(parts)


def mcp_tool(bridge: McpBridge, index: int, listed: Any) -> Tool:
    """Tool ``listed`` (an ``mcp.types.Tool`` of server ``index``) as a grimoire tool."""
    name = listed.name

    def call(**arguments: Any) -> str:
        result = bridge.call(index, name, arguments, CALL_TIMEOUT)
        text = result_text(result)
        if result.isError:
            raise McpToolError(text)
        return text

    call.__name__ = call.__qualname__ = name
    signature = _signature(listed.inputSchema or {})
    if signature is not None:
        call.__signature__ = signature  # type: ignore[attr-defined]
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": listed.description or "",
            "parameters": listed.inputSchema or {"type": "object", "properties": {}},
        },
    }
    return Tool(name, call, schema)


@dataclass
class McpToolset:
    """The tools of a run's MCP servers and the bridge that calls them (close it at the end)."""

    tools: list[Tool]
    bridge: McpBridge

    def close(self) -> None:
        self.bridge.close()


def connect_mcp_tools(
    servers: Sequence[McpServer],
    taken: Iterable[str] = (),
    where: str = "loss.args.mcp_servers",
    timeout: float = START_TIMEOUT,
) -> McpToolset:
    """Start or reach every server, list its tools (``taken``: names already used by other
    tools). Raises one :class:`ConfigError` naming ``where[i]`` for a server that does not
    start or answer, a ``tools`` name it does not list, or a tool name used twice."""
    bridge = McpBridge(servers)
    problems: list[str] = []
    owner = dict.fromkeys(taken, "loss.args.tools")
    tools: list[Tool] = []
    for i, server in enumerate(servers):
        try:
            listed = bridge.list_tools(i, timeout)
        except McpServerError as exc:
            problems.append(f"{where}[{i}]: cannot list its tools: {exc}")
            continue
        names = [t.name for t in listed]
        missing = [n for n in server.tools or () if n not in names]
        if missing:
            problems.append(
                f"{where}[{i}].tools: server {server.label} has no tool {missing!r} "
                f"(tools: {', '.join(names) or 'none'})"
            )
        for t in listed:
            if server.tools is not None and t.name not in server.tools:
                continue
            if t.name in owner:
                problems.append(
                    f"{where}[{i}]: tool {t.name!r} is also in {owner[t.name]}; names must "
                    "differ (take a subset with 'tools')"
                )
                continue
            owner[t.name] = f"{where}[{i}]"
            tools.append(mcp_tool(bridge, i, t))
    if problems:
        bridge.close()
        raise ConfigError(problems)
    return McpToolset(tools, bridge)


__all__ = [
    "CALL_TIMEOUT",
    "START_TIMEOUT",
    "McpToolError",
    "McpToolset",
    "connect_mcp_tools",
    "mcp_tool",
    "parse_mcp_servers",
    "result_text",
]
