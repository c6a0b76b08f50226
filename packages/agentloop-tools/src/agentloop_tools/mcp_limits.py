"""A byte limit on what an MCP server sends, applied where the bytes arrive (the HTTP client;
:mod:`agentloop_tools.mcp_stdio` for stdio servers), before anything is parsed.

The MCP client reads a JSON response whole (``response.aread()``) and then parses it into
pydantic models and Python strings: a 100 MB result costs about 1 GB, though the model reads only
``max_tool_response_length`` characters of it. The HTTP clients built here count the bytes of
each response as they arrive and stop at ``max_result_bytes``: a JSON body is cut off as a whole,
an event stream per event (a long-lived stream carries many messages), so memory holds at most
one limit's worth per call.
"""

from __future__ import annotations

from typing import Any

RESULT_TOO_LARGE = "exceeds max_result_bytes"
"""Marks the error of a result cut off at the limit (the MCP client wraps it in its own error)."""


def result_too_large_error() -> type[Exception]:
    """The exception a bounded stream raises: both an ``httpx2.StreamError`` (the MCP client turns
    it into a JSON-RPC error for the waiting call when a JSON body is cut) and an ``SSEError``
    (the same when an event stream is cut), so the call fails at once with this message instead
    of waiting for its timeout."""
    import httpx2

    class MCPResultTooLargeError(httpx2.SSEError, httpx2.StreamError):
        def __init__(self, message: str) -> None:
            httpx2.SSEError.__init__(self, message)

    return MCPResultTooLargeError


def too_large_message(limit: int, where: str) -> str:
    """The error text of a message cut off at ``limit`` bytes (every transport words it alike:
    :meth:`MCPToolset.call_tool` recognises it by :data:`RESULT_TOO_LARGE`)."""
    return (f"the MCP server {where} sent more than {limit:,} bytes for one message; the result "
            f"{RESULT_TOO_LARGE} ({limit:,}) and was dropped unread (raise max_result_bytes in the "
            "server's mcpServers entry, or null for no limit, if the tool really returns that much)")


_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r\n")


class _Counter:
    """Counts the bytes of one response: all of them, or those since the last event end when
    ``per_event`` (a server-sent event ends at a blank line)."""

    def __init__(self, per_event: bool) -> None:
        self.per_event, self.pending, self.tail = per_event, 0, b""

    def add(self, chunk: bytes) -> int:
        if not self.per_event:
            self.pending += len(chunk)
            return self.pending
        window = self.tail + chunk
        ends = [i + len(e) for e in _EVENT_ENDS if (i := window.rfind(e)) >= 0]
        self.pending = len(window) - max(ends) if ends else self.pending + len(chunk)
        self.tail = window[-2:]
        return self.pending


def bounded_http_client_factory(limit: int, where: str) -> Any:
    """An ``httpx_client_factory`` for fastmcp's HTTP transports whose responses stop at ``limit``
    bytes (per event on event streams)."""
    import httpx2

    error = result_too_large_error()

    def too_large() -> Exception:
        return error(too_large_message(limit, where))

    class BoundedStream(httpx2.AsyncByteStream):
        """Raises once ``limit`` bytes arrive without an end (the body, or one event)."""

        def __init__(self, inner: Any, per_event: bool, announced: int) -> None:
            self.inner, self.per_event, self.announced = inner, per_event, announced

        async def __aiter__(self):
            if self.announced > limit:  # a Content-Length over the limit: not a byte is read
                raise too_large()
            counter = _Counter(self.per_event)
            async for chunk in self.inner:
                if counter.add(chunk) > limit:
                    raise too_large()
                yield chunk

        async def aclose(self) -> None:
            await self.inner.aclose()

    class RefusedStream(httpx2.AsyncByteStream):
        def __init__(self, message: str) -> None:
            self.message = message

        async def __aiter__(self):
            raise error(self.message)
            yield b""  # pragma: no cover - makes this an async generator

    class BoundedTransport(httpx2.AsyncBaseTransport):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def handle_async_request(self, request: Any) -> Any:
            # Compressed bytes would be counted before they expand (a gzip bomb): ask for none.
            request.headers["Accept-Encoding"] = "identity"
            response = await self.inner.handle_async_request(request)
            encoding = response.headers.get("content-encoding", "identity").lower()
            if encoding not in ("", "identity"):
                await response.aclose()
                response.headers["content-encoding"] = "identity"
                response.stream = RefusedStream(f"the MCP server {where} sent a {encoding}-encoded response though "
                                                f"asked for none; refused (it could expand past the limit: it "
                                                f"{RESULT_TOO_LARGE})")
                return response
            per_event = response.headers.get("content-type", "").lower().startswith("text/event-stream")
            length = response.headers.get("content-length", "")
            announced = int(length) if length.isdigit() and not per_event else 0
            response.stream = BoundedStream(response.stream, per_event, announced)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    def factory(headers: dict[str, str] | None = None, timeout: Any = None, auth: Any = None,
                **kwargs: Any) -> Any:
        kwargs.setdefault("follow_redirects", True)
        return httpx2.AsyncClient(
            headers=headers, auth=auth, transport=BoundedTransport(httpx2.AsyncHTTPTransport()),
            # MCP's own defaults: a long read timeout, calls carry their own.
            timeout=timeout if timeout is not None else httpx2.Timeout(30.0, read=300.0), **kwargs)

    return factory


__all__ = ["RESULT_TOO_LARGE", "bounded_http_client_factory", "result_too_large_error", "too_large_message"]
