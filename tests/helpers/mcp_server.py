"""An MCP tool server for the tests, written with the ``mcp`` SDK's FastMCP.

``python tests/helpers/mcp_server.py`` serves over stdio; ``... --port PORT`` over streamable
HTTP at ``http://127.0.0.1:PORT/mcp``. Its tools: ``lookup`` (the tiny model's lookup task:
the reverse of a word), ``add``, ``fail`` (raises), ``nap`` (sleeps) and ``crash`` (the server
process exits in the middle of the call).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Annotated

from mcp.server.fastmcp import FastMCP
from pydantic import Field

server = FastMCP("grimoire-test-tools", log_level="WARNING")


@server.tool()
def lookup(word: Annotated[str, Field(description="the word to look up")]) -> str:
    """The reverse of a word."""
    return word[::-1]


@server.tool()
def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Raise an error with this message."""
    raise ValueError(message)


@server.tool()
def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Exit the server process in the middle of the call."""
    os._exit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=None)
    port = parser.parse_args().port
    if port is None:
        server.run("stdio")
    else:
        server.settings.host, server.settings.port = "127.0.0.1", port
        server.run("streamable-http")
