"""MCP tools: every tool of a Model Context Protocol server becomes a :class:`BaseTool`.

Configured with the usual ``mcpServers`` mapping::

    {"mcpServers": {
        "search": {"url": "http://127.0.0.1:8000/mcp", "transport": "http",
                   "auth_token": "...", "rate_limit": 5, "connect_retries": 5},
        "local":  {"command": "python", "args": ["server.py"]}}}

Needs the ``mcp`` extra (fastmcp), imported only when a server is contacted. Secrets
(``auth_token`` and every header value) are kept in :class:`Secret` wrappers: they never appear
in ``repr()``, logs, metrics or error messages.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.mcp_config import MCPServerConfig, Secret, TokenBucket, parse_mcp_servers
from agentloop_tools.mcp_limits import RESULT_TOO_LARGE, bounded_http_client_factory
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "MCPServerConfig",
    "MCPTool",
    "MCPToolset",
    "Secret",
    "TokenBucket",
    "aload_mcp_tools",
    "load_mcp_tools",
    "parse_mcp_servers",
]

logger = logging.getLogger(__name__)

_INSTALL_HINT = 'MCP tools need fastmcp: pip install "agentloop-tools[mcp]"'


def _import_fastmcp():
    try:
        import fastmcp
        from fastmcp.client import transports
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return fastmcp, transports


class MCPToolset:
    """A connection to one MCP server: lists its tools and calls them, with retries, a rate
    limit and bearer auth. One connected client per event loop, opened on first use.

    Args:
        server: The server's settings.
    """

    def __init__(self, server: MCPServerConfig) -> None:
        self.server = server
        self.rate_limiter = TokenBucket(server.rate_limit, server.rate_burst) if server.rate_limit else None
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"MCPToolset(server={self.server.name!r}, url={self.server.display_url!r})"

    def _make_client(self):
        fastmcp, transports = _import_fastmcp()
        s = self.server
        headers = {k: v.get() for k, v in s.headers.items()}
        if s.auth_token is not None:
            headers["Authorization"] = f"Bearer {s.auth_token.get()}"
        # Bounded where the bytes arrive, before the MCP client parses them (mcp_limits).
        factory = None if s.max_result_bytes is None else bounded_http_client_factory(s.max_result_bytes, repr(s.name))
        if s.transport == "http":
            transport = transports.StreamableHttpTransport(s.url, headers=headers or None, httpx_client_factory=factory,
                                                           max_sse_event_size=s.max_result_bytes)
        elif s.transport == "sse":
            transport = transports.SSETransport(s.url, headers=headers or None, httpx_client_factory=factory)
        elif s.max_result_bytes is None:
            transport = transports.StdioTransport(
                s.command, s.args, env={k: v.get() for k, v in s.env.items()} or None, cwd=s.cwd
            )
        else:
            # The extra is installed (checked above): the bounded stdio client can be imported.
            from agentloop_tools.mcp_stdio import BoundedStdioTransport

            transport = BoundedStdioTransport(s.command or "", list(s.args or []),
                                              {k: v.get() for k, v in s.env.items()} or None, s.cwd,
                                              limit=s.max_result_bytes, where=repr(s.name))
        return fastmcp.Client(transport, timeout=s.timeout_s)

    async def _open_client(self):
        """Connect, retrying with exponential backoff while the server starts."""
        _import_fastmcp()  # a missing extra is an ImportError, not something to retry
        s = self.server
        delay = s.retry_backoff_s
        last: BaseException | None = None
        for attempt in range(1, s.connect_retries + 1):
            client = self._make_client()
            try:
                await client.__aenter__()
                return client
            except Exception as exc:  # fastmcp wraps connect failures in several exception types
                last = exc
                logger.info("MCP server %r at %s: connect attempt %d/%d failed (%s)",
                            s.name, s.display_url, attempt, s.connect_retries, type(exc).__name__)
                if attempt < s.connect_retries:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 4.0)
        hint = "; check auth_token/headers" if "error response" in str(last) else ""
        raise ConnectionError(
            f"MCP server {s.name!r} at {s.display_url}: could not connect after {s.connect_retries} "
            f"attempts ({type(last).__name__}: {_scrub(str(last), s)}){hint}; is the server running? "
            "Raise connect_retries/retry_backoff_s if it starts slowly"
        ) from None

    async def _client(self):
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is not None and client.is_connected():
            return client
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            client = self._clients.get(loop)
            if client is None or not client.is_connected():
                client = await self._open_client()
                self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close this event loop's connection (reopened on next use)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            try:
                await client.__aexit__(None, None, None)
            except Exception as exc:  # closing a half-dead connection should not mask the caller's error
                logger.debug("closing MCP client for %r failed: %s", self.server.name, type(exc).__name__)

    async def _drop(self, client: Any) -> None:
        """Close ``client`` if it is still this loop's connection (a concurrent call may have
        replaced it already; closing the new one would fail that call's neighbours)."""
        loop = asyncio.get_running_loop()
        if self._clients.get(loop) is client:
            await self.aclose()

    async def list_tools(self) -> list[OpenAIFunctionToolSchema]:
        """The server's tools as OpenAI schemas, filtered by ``tool_selected_list``.

        Raises:
            ConnectionError: The server could not be reached.
            ValueError: A name in ``tool_selected_list`` is not on the server.
        """
        client = await self._client()
        tools = await client.list_tools()
        by_name = {t.name: t for t in tools}
        selected = self.server.tool_selected_list
        if selected is not None:
            missing = sorted(set(selected) - set(by_name))
            if missing:
                raise ValueError(
                    f"MCP server {self.server.name!r}: tool_selected_list names {missing}, which the "
                    f"server does not offer (it has {sorted(by_name)})"
                )
            tools = [by_name[n] for n in selected]
        schemas = []
        for tool in tools:
            params = dict(tool.input_schema or {"type": "object", "properties": {}})
            params.setdefault("type", "object")
            schemas.append(
                OpenAIFunctionToolSchema.model_validate(
                    {"type": "function",
                     "function": {"name": tool.name, "description": tool.description or "", "parameters": params}}
                )
            )
        return schemas

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[ToolResponse, dict[str, Any]]:
        """Call a remote tool (after the rate limiter). A tool error on the server comes back as
        a :class:`ToolResponse` with the error text; a broken connection is retried once with a
        fresh connection, then raised.

        Returns:
            ``(response, metrics)`` with ``mcp_is_error`` and ``mcp_rate_wait_s`` metrics, and
            ``mcp_result_too_large`` (1) when the result passed ``max_result_bytes`` and the
            model reads an error naming the limit instead.

        Raises:
            ConnectionError: The server could not be reached.
        """
        waited = await self.rate_limiter.acquire() if self.rate_limiter else 0.0
        result: Any = None
        for attempt in (1, 2):
            try:
                client = await self._client()
            except asyncio.CancelledError:
                # Cancelled while connecting: the call never reached the server.
                if self.rate_limiter and attempt == 1:
                    self.rate_limiter.refund()
                raise
            try:
                result = await client.call_tool(name, arguments, raise_on_error=False)
                break
            except Exception as exc:
                if RESULT_TOO_LARGE in str(exc):
                    # Cut off where the bytes arrived: the connection is fine, the result is gone.
                    logger.warning("MCP server %r: the result of %r %s (%s bytes); the model reads an error",
                                   self.server.name, name, RESULT_TOO_LARGE, self.server.max_result_bytes)
                    text = (f"Error: the result of {name!r} was larger than the {self.server.max_result_bytes:,} bytes "
                            "allowed (max_result_bytes) and was dropped unread")
                    if self.server.transport == "stdio":
                        await self._drop(client)  # a stdio connection ends at the cut (mcp_stdio)
                    return ToolResponse(text=text), {"mcp_is_error": True, "mcp_rate_wait_s": waited,
                                                     "mcp_result_too_large": 1}
                answered = _is_error_response(exc)
                if not answered:
                    await self._drop(client)
                # An error response (quota, 429, auth) means the connection works and is shared by
                # concurrent calls: closing it would fail them all, and a retry only burns quota.
                if attempt == 2 or answered:
                    raise ConnectionError(
                        f"MCP server {self.server.name!r} at {self.server.display_url}: call to {name!r} "
                        f"failed ({type(exc).__name__}: {_scrub(str(exc), self.server)})"
                    ) from None
        response = _to_tool_response(result.content, result.structured_content, bool(result.is_error))
        return response, {"mcp_is_error": bool(result.is_error), "mcp_rate_wait_s": waited}


_CONNECTION_CLOSED = -32000
"""The JSON-RPC code of mcp's "Connection closed": the connection was lost, nothing was answered."""


def _is_error_response(exc: BaseException) -> bool:
    # mcp's MCPError (McpError in older releases): the server replied with an error.
    return (type(exc).__module__.startswith("mcp.") and type(exc).__name__.lower() == "mcperror"
            and getattr(exc, "code", None) != _CONNECTION_CLOSED)


def _scrub(text: str, server: MCPServerConfig) -> str:
    secrets = [v.get() for v in server.headers.values()] + [v.get() for v in server.env.values()]
    if server.auth_token is not None:
        secrets.append(server.auth_token.get())
    for value in secrets:
        if value:
            text = text.replace(value, "***")
    return text


def _image(item: Any, texts: list[str]) -> Any:
    """An MCP image content item as a lazily opened PIL image (the header only is read, so the
    loop's pixel limit still refuses a decompression bomb before it is decoded); its bytes when
    PIL cannot open them, so the loop refuses it with the reason; or a note in ``texts``."""
    # mcp >= 2 names it mime_type; reading mimeType there warns.
    mime = getattr(item, "mime_type", None) or getattr(item, "mimeType", None) or "image"
    try:
        data = base64.b64decode(item.data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        texts.append(f"[image ({mime}) omitted: the server sent invalid base64]")
        return None
    try:
        import io

        from PIL import Image
    except ImportError:
        texts.append(f"[image ({mime}) omitted: pip install pillow to pass images to the model]")
        return None
    try:
        return Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - unreadable or a bomb PIL refuses: the loop names why
        return data


def _to_tool_response(content: list[Any], structured: Any, is_error: bool) -> ToolResponse:
    texts: list[str] = []
    images: list[Any] = []
    for item in content or []:
        kind = getattr(item, "type", None)
        if kind == "text":
            texts.append(item.text)
        elif kind == "image":
            images.append(_image(item, texts))
        else:
            # Resources, audio...: show them as JSON rather than drop them.
            texts.append(json.dumps(item.model_dump(mode="json", exclude_none=True), ensure_ascii=False))
    if not texts and structured is not None:
        texts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(texts)
    if is_error and not text.lower().startswith("error"):
        text = f"Error: {text}"
    return ToolResponse(text=text, image=[i for i in images if i is not None] or None)


class MCPTool(BaseTool):
    """One remote MCP tool. Built by :func:`load_mcp_tools` / :meth:`MCPToolset`; the schema is
    the server's own input schema. Subclass it to post-process results (override
    :meth:`execute` and call ``super().execute``).

    Args:
        config: Tool config (``timeout_s``...).
        tool_schema: The remote tool's schema.
        toolset: The server connection.
    """

    def __init__(self, config: dict[str, Any] | None, tool_schema: Any, toolset: MCPToolset) -> None:
        super().__init__(config, tool_schema)
        self.toolset = toolset

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, server={self.toolset.server.name!r})"

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        self.state(instance_id)
        response, metrics = await self.toolset.call_tool(self.name, parameters)
        return response, 0.0, metrics


async def aload_mcp_tools(
    config: Mapping[str, Any] | str | Path,
    *,
    tool_selected_list: list[str] | None = None,
    tool_class: type[MCPTool] = MCPTool,
    tool_config: dict[str, Any] | None = None,
) -> dict[str, MCPTool]:
    """Async form of :func:`load_mcp_tools`."""
    tools: dict[str, MCPTool] = {}
    owner: dict[str, str] = {}
    for server in parse_mcp_servers(config):
        if tool_selected_list is not None and server.tool_selected_list is None:
            server.tool_selected_list = list(tool_selected_list)
        toolset = MCPToolset(server)
        try:
            schemas = await toolset.list_tools()
        finally:
            # The listing connection belongs to this (maybe temporary) loop; calls reopen their own.
            await toolset.aclose()
        for schema in schemas:
            if schema.name in tools:
                raise ValueError(
                    f"MCP tool {schema.name!r} is offered by both server {owner[schema.name]!r} and "
                    f"{server.name!r}; restrict one with tool_selected_list"
                )
            tools[schema.name] = tool_class(dict(tool_config or {}), schema, toolset)
            owner[schema.name] = server.name
    return tools


def load_mcp_tools(
    config: Mapping[str, Any] | str | Path,
    *,
    tool_selected_list: list[str] | None = None,
    tool_class: type[MCPTool] = MCPTool,
    tool_config: dict[str, Any] | None = None,
) -> dict[str, MCPTool]:
    """Connect to every server in an ``mcpServers`` config and wrap its tools.

    Safe to call from sync code or from inside a running event loop (the listing then runs on
    a private loop in a helper thread).

    Args:
        config: ``{"mcpServers": {...}}`` or a JSON/YAML file path holding it.
        tool_selected_list: Default filter for servers that set none.
        tool_class: :class:`MCPTool` subclass to instantiate.
        tool_config: Config passed to each tool (``timeout_s``...).

    Returns:
        Tools by name.

    Raises:
        ImportError: fastmcp is not installed.
        ConnectionError: A server could not be reached after its retries.
        ValueError: Bad config, or two servers offer the same tool name.
    """
    load = functools.partial(aload_mcp_tools, config, tool_selected_list=tool_selected_list,
                             tool_class=tool_class, tool_config=tool_config)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(load())
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(load())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=runner, name="agentloop-mcp-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
