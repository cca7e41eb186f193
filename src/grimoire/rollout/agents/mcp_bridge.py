"""A synchronous bridge to MCP servers: one background event loop owns a run's connections.

The MCP client (the ``mcp`` package) is asynchronous and its connections live inside ``anyio``
task groups, which must be entered and left by the same task. Episodes are played
synchronously, from the learner's thread or an asynchronous rollout producer's, and each tool
call runs in a thread of its own under the environment's timeout
(:func:`~grimoire.rollout.agents.toolbox.call_with_timeout`). So :class:`McpBridge` runs one
event loop in a daemon thread, started at the first request; each server's connection is held
open there by a task of its own (:meth:`McpBridge._hold`) until :meth:`McpBridge.close`, and
any thread sends it requests with :func:`asyncio.run_coroutine_threadsafe`.

A connection that is found closed (the server process exited, the HTTP server went away) is
dropped and opened again at the next request, so one crash costs the calls in flight, not the
rest of the run. Every bridge still open is closed at interpreter exit (its stdio servers are
stopped), and a closed bridge reopens its connections if it is used again.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: What installs the client, named in the error when it is missing.
EXTRA = "pip install 'grimoire[mcp]'"


class McpServerError(RuntimeError):
    """A request to an MCP server that got no answer: it could not be started or reached, its
    connection closed, or it did not answer in time."""


def import_mcp() -> Any:
    """The ``mcp`` package, or an :class:`ImportError` naming the extra that installs it."""
    try:
        import mcp
        from mcp.client.stdio import stdio_client  # noqa: F401 (the transports: part of the check)
        from mcp.client.streamable_http import streamable_http_client  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"MCP tool servers need the MCP client: {EXTRA} ({exc})") from exc
    return mcp


@dataclass(frozen=True)
class McpServer:
    """How to reach one MCP server: a command to start (stdio) or a URL (streamable HTTP).

    ``label`` names it in errors and logs; ``tools``: the names to take from it (None: all).
    """

    label: str
    command: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] | None = None
    tools: tuple[str, ...] | None = None


@contextlib.asynccontextmanager
async def _http(url: str, headers: Mapping[str, str] | None) -> AsyncIterator[Any]:
    """A streamable HTTP connection's streams, with the MCP SDK's HTTP client settings (30 s to
    connect and send, 5 min to read an event stream)."""
    import httpx
    from mcp.client.streamable_http import streamable_http_client

    timeout = httpx.Timeout(30.0, read=300.0)
    client = httpx.AsyncClient(headers=dict(headers or {}), timeout=timeout, follow_redirects=True)
    async with client, streamable_http_client(url, http_client=client) as streams:
        yield streams


def _transport(server: McpServer) -> Any:
    """The ``mcp`` client context manager that opens ``server``'s (read, write) streams."""
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    if server.url is not None:
        return _http(server.url, server.headers)
    command, *args = server.command
    env = None if server.env is None else dict(server.env)
    return stdio_client(StdioServerParameters(command=command, args=args, env=env, cwd=server.cwd))


def describe(exc: BaseException) -> str:
    """``Type: message`` of an error, the innermost of ``anyio``'s one-error groups."""
    inner = getattr(exc, "exceptions", None)  # an ExceptionGroup (3.11, or the backport)
    while isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    text = str(exc) or "connection closed"
    return f"{type(exc).__name__}: {text}"


def _closed(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection is gone (open it again at the next call)."""
    import anyio
    from mcp.shared.exceptions import McpError
    from mcp.types import CONNECTION_CLOSED

    if isinstance(exc, McpError):
        return exc.error.code == CONNECTION_CLOSED
    gone = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)
    return isinstance(exc, gone)


@dataclass
class _Link:
    """An open connection and how to close it (loop-owned)."""

    session: Any
    stop: asyncio.Event
    task: asyncio.Task


_OPEN: weakref.WeakSet[McpBridge] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for bridge in list(_OPEN):
        bridge.close()


class McpBridge:
    """Synchronous requests to ``servers`` (module docstring); thread-safe."""

    def __init__(self, servers: Sequence[McpServer]):
        self.servers = list(servers)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._links: dict[int, _Link] = {}  # touched by the loop's thread only
        self._opening: dict[int, asyncio.Lock] = {}

    # ------------------------------------------------------------------ the caller's side

    @property
    def running(self) -> bool:
        """Whether the loop runs (started by a request, stopped by :meth:`close`)."""
        return self._loop is not None

    def list_tools(self, index: int, timeout: float) -> list[Any]:
        """Every tool server ``index`` lists (``mcp.types.Tool``: name, description,
        inputSchema), all pages; opens its connection. Raises :class:`McpServerError`."""
        return self._run(self._list(index), timeout, index)

    def call(self, index: int, name: str, arguments: Mapping[str, Any], timeout: float) -> Any:
        """Server ``index``'s ``CallToolResult`` of tool ``name``; a tool's own error is a
        result (``isError``), a request without an answer raises :class:`McpServerError`."""
        return self._run(self._call(index, name, dict(arguments), timeout), timeout + 1.0, index)

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection (stdio servers are asked to exit, then stopped) and the loop."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            _OPEN.discard(self)
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close_links(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="grimoire-mcp", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                self._links, self._opening = {}, {}
                _OPEN.add(self)
            return self._loop

    def _run(self, coro: Any, timeout: float, index: int) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._start())
        label = self.servers[index].label
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise McpServerError(f"MCP server {label}: no answer within {timeout:g}s") from None
        except McpServerError:
            raise
        except (Exception, concurrent.futures.CancelledError) as exc:
            raise McpServerError(f"MCP server {label}: {describe(exc)}") from exc

    # ------------------------------------------------------------------ the loop's side

    async def _list(self, index: int) -> list[Any]:
        session = await self._session(index)
        tools, cursor = [], None
        while True:
            page = await session.list_tools(cursor)
            tools.extend(page.tools)
            cursor = page.nextCursor
            if not cursor:
                return tools

    async def _call(self, index: int, name: str, arguments: dict[str, Any], timeout: float) -> Any:
        session = await self._session(index)
        try:
            return await session.call_tool(name, arguments, timedelta(seconds=timeout))
        except Exception as exc:
            if _closed(exc):  # the server is gone: the next call starts or reaches it again
                await self._drop(index, session)
            raise

    async def _session(self, index: int) -> Any:
        link = self._links.get(index)
        if link is not None and not link.task.done():
            return link.session
        async with self._opening.setdefault(index, asyncio.Lock()):
            link = self._links.get(index)
            if link is not None and not link.task.done():
                return link.session
            ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            stop = asyncio.Event()
            task = asyncio.create_task(self._hold(self.servers[index], ready, stop))
            try:
                session = await ready
            except BaseException:
                stop.set()
                task.cancel()
                raise
            self._links[index] = _Link(session, stop, task)
            return session

    async def _hold(self, server: McpServer, ready: asyncio.Future[Any], stop: asyncio.Event):
        """Open ``server``'s connection, hand it over through ``ready``, keep it until ``stop``:
        the transport's task group is entered and left by this one task."""
        from mcp import ClientSession

        try:
            async with _transport(server) as streams, ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                ready.set_result(s)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _drop(self, index: int, session: Any) -> None:
        link = self._links.get(index)
        if link is not None and link.session is session:
            del self._links[index]
            link.stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(link.task, 5.0)

    async def _close_links(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            link.stop.set()
        if links:
            await asyncio.wait([link.task for link in links], timeout=8.0)


__all__ = ["EXTRA", "McpBridge", "McpServer", "McpServerError", "describe", "import_mcp"]
