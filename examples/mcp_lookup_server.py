"""The MCP tool server examples/mcp_tools.yaml starts (over stdio), written with fastmcp.

Its one tool, ``lookup``, answers the tiny lookup task's question: the reverse of a word. Run it
by hand with ``python examples/mcp_lookup_server.py`` (it then waits for an MCP client on stdin),
or over HTTP with ``--port 8000`` (``url: http://127.0.0.1:8000/mcp`` in the YAML instead of
``command``).
"""

from __future__ import annotations

import argparse
from typing import Annotated

from fastmcp import FastMCP
from pydantic import Field

server = FastMCP("lookup")


@server.tool
def lookup(word: Annotated[str, Field(description="the word to look up")]) -> str:
    """The reverse of a word."""
    return word[::-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=None, help="serve over HTTP on this port")
    port = parser.parse_args().port
    if port is None:
        server.run(show_banner=False, log_level="WARNING")
    else:
        server.run("http", host="127.0.0.1", port=port, show_banner=False, log_level="WARNING")
