"""The byte limit of :mod:`agentloop_tools.mcp_limits` for MCP servers run as a subprocess
(the stdio transport).

The MCP SDK's stdio client joins the server's stdout into one string until a newline arrives:
a 200 MB result is held whole (then parsed, ~10x that), and a server that never sends the
newline grows the client until it is killed. The client here splits the bytes into lines as they
arrive and stops at ``max_result_bytes`` per line (one JSON-RPC message), before anything is
decoded or parsed.

A line over the limit may never end, and stdio has no other message boundary to resync on, so
the connection is closed there (the next call starts the server again). The call whose result it
was gets the same error as on HTTP (naming ``max_result_bytes``, see :func:`too_large_message`),
found by the request id at the start of the message (where the Python SDK and fastmcp put it)
or, failing that, because it is the only call in flight; any other call in flight sees the
connection close and is retried once on a fresh one by :meth:`MCPToolset.call_tool`.

Needs the ``mcp`` extra; :mod:`agentloop_tools.mcp` imports this module when it builds a client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import AsyncGenerator
from typing import Any, TextIO

import anyio
import mcp_types as types
from fastmcp.client.transports import ClientTransport
from fastmcp.client.transports.base import TransportOptions
from mcp.client.stdio import StdioServerParameters, get_default_environment

# The SDK's spawn (its own session / Windows job, so the whole tree can be killed) and its
# shutdown sequence (close stdin, grace period, kill the tree): reused rather than copied.
from mcp.client.stdio import _create_platform_compatible_process as _spawn
from mcp.client.stdio import _stop_server_process as _stop
from mcp.shared.message import SessionMessage

from agentloop_tools.mcp_limits import too_large_message

__all__ = ["BoundedStdioTransport", "LineSplitter", "bounded_stdio_client", "request_id_at_start"]

logger = logging.getLogger(__name__)

_HEAD_BYTES = 512
"""Bytes kept of a line over the limit, to read its request id from."""

_WRITER_FLUSH_S = 0.5
"""Time for the writer to flush accepted messages before stdin closes (the SDK's too)."""

_ID_AT_START = re.compile(rb'\A\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')


class LineSplitter:
    """Splits a byte stream into newline-ended lines of at most ``limit`` bytes each; holds at
    most ``limit`` bytes plus one chunk.

    Args:
        limit: Most bytes one line may have (the newline not counted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> tuple[list[bytes], bytes | None]:
        """The lines ``chunk`` completes, and the first :data:`_HEAD_BYTES` of a line that passed
        the limit (None while none has; after one, the splitter is done)."""
        lines: list[bytes] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if len(self._buffer) + end - start > self.limit:
                return lines, bytes((self._buffer + chunk[start:start + _HEAD_BYTES])[:_HEAD_BYTES])
            lines.append(bytes(self._buffer) + chunk[start:end])
            self._buffer.clear()
            start = end + 1
        self._buffer += chunk[start:]
        if len(self._buffer) > self.limit:
            return lines, bytes(self._buffer[:_HEAD_BYTES])
        return lines, None


def request_id_at_start(head: bytes) -> Any:
    """The ``id`` of a JSON-RPC message whose first bytes are ``head``, when it comes first (or
    right after ``"jsonrpc"``); None otherwise."""
    match = _ID_AT_START.match(head)
    if match is None:
        return None
    try:
        return json.loads(match.group(1))
    except ValueError:
        return None


def _parse(line: bytes, server: StdioServerParameters) -> SessionMessage | Exception:
    try:
        text = line.decode(server.encoding, errors=server.encoding_error_handler)
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(text, by_name=False))
    except ValueError as exc:  # a parse error is a value the session surfaces, as in the SDK
        logger.warning("an MCP server sent a line that is not a JSON-RPC message: %s", type(exc).__name__)
        return exc


@contextlib.asynccontextmanager
async def bounded_stdio_client(server: StdioServerParameters, limit: int, where: str,
                               errlog: TextIO = sys.stderr) -> AsyncGenerator[tuple[Any, Any], None]:
    """The SDK's ``stdio_client`` with each message of the server bounded by ``limit`` bytes.

    Args:
        server: The command to run and its environment.
        limit: ``max_result_bytes``.
        where: The server, for the error (its name, quoted).
        errlog: Where the server's stderr goes.

    Yields:
        ``(read_stream, write_stream)`` for a ``ClientSession``.
    """
    process = await _spawn(command=server.command, args=server.args,
                           env=get_default_environment() | (server.env or {}), errlog=errlog, cwd=server.cwd)
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    pending: dict[Any, None] = {}  # ids of the requests sent and not answered yet
    writer_done = anyio.Event()

    async def answer_too_large(head: bytes) -> None:
        guilty = request_id_at_start(head)
        if guilty not in pending:
            guilty = next(iter(pending)) if len(pending) == 1 else None
        logger.warning("MCP server %s: a message passed max_result_bytes (%s bytes); closing the connection "
                       "(the next call restarts the server)", where, f"{limit:,}")
        if guilty is not None:
            error = types.ErrorData(code=types.INTERNAL_ERROR, message=too_large_message(limit, where))
            await read_writer.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=guilty, error=error)))

    async def stdout_reader() -> None:
        assert process.stdout is not None, "the server is spawned with pipes"
        lines = LineSplitter(limit)
        try:
            async with read_writer:
                async for chunk in process.stdout:
                    complete, over = lines.feed(chunk)
                    for line in complete:
                        if not line.strip():
                            continue
                        message = _parse(line, server)
                        if isinstance(message, SessionMessage) and isinstance(
                                message.message, types.JSONRPCResponse | types.JSONRPCError):
                            pending.pop(message.message.id, None)
                        await read_writer.send(message)
                    if over is not None:
                        await answer_too_large(over)
                        # The rest of the line is never read: closing the pipe makes a server still
                        # writing it fail at once (EPIPE) rather than block until it is killed.
                        await process.stdout.aclose()
                        return  # closing read_writer ends the session
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError, OSError):
            pass  # the session or the pipe went away: the session sees the stream end

    async def stdin_writer() -> None:
        assert process.stdin is not None, "the server is spawned with pipes"
        try:
            async with write_reader:
                async for session_message in write_reader:
                    message = session_message.message
                    if isinstance(message, types.JSONRPCRequest):
                        pending[message.id] = None
                    data = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode(server.encoding, errors=server.encoding_error_handler))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()  # the server may live on: end the session rather than hang a request
        finally:
            writer_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            # Shielded and bounded at every wait, as in the SDK: a cancelled caller must not leak
            # a live server process.
            with anyio.CancelScope(shield=True):
                read_stream.close()
                write_stream.close()
                with anyio.move_on_after(_WRITER_FLUSH_S):
                    await writer_done.wait()
                await _stop(process)
                for stream in (read_stream, write_stream, read_writer, write_reader):
                    await stream.aclose()
            tg.cancel_scope.cancel()


class BoundedStdioTransport(ClientTransport):
    """fastmcp's stdio transport with :func:`bounded_stdio_client` (one server process per
    connection; :class:`MCPToolset` keeps one connection per event loop).

    Args:
        command: The server's executable.
        args: Its arguments.
        env: Extra environment variables (over the SDK's safe defaults).
        cwd: Its working directory.
        limit: ``max_result_bytes``.
        where: The server, for errors (its name, quoted).
    """

    def __init__(self, command: str, args: list[str], env: dict[str, str] | None, cwd: str | None, *,
                 limit: int, where: str) -> None:
        self.params = StdioServerParameters(command=command, args=list(args), env=env, cwd=cwd)
        self.limit, self.where = limit, where

    @contextlib.asynccontextmanager
    async def connect_session(self, *, transport_options: TransportOptions | None = None,
                              **session_kwargs: Any) -> AsyncGenerator[Any, None]:
        options = transport_options or TransportOptions()
        async with (bounded_stdio_client(self.params, self.limit, self.where) as (read_stream, write_stream),
                    options.session_class(read_stream, write_stream, **session_kwargs) as session):
            yield session

    def __repr__(self) -> str:
        return f"<BoundedStdioTransport(command={self.params.command!r}, limit={self.limit})>"
