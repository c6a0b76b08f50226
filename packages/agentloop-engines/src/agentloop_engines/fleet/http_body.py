"""Reading a remote engine server's answers within a byte limit (the client side of HTTP).

:class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` trusts nothing about the server at the
other end of its URL: a misconfigured proxy, a wrong port or a hostile host can answer with a
body that never ends. Read whole (``httpx``'s ``response.json()``), such a body fills the
trainer's memory before anything looks at it. So every answer is read here chunk by chunk and
counted as it arrives, against ``max_response_bytes``; past it the connection is dropped and
the call fails with :class:`~agentloop_engines.fleet.http_errors.ResponseTooLargeError` (a
``EngineHTTPError``) naming the limit and the setting.

Bytes are counted as they arrive on the wire, undecoded: the client asks for
``Accept-Encoding: identity`` (an agentloop server never compresses) and refuses an answer in
any other encoding, since a few kilobytes of gzip inflate to gigabytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from agentloop_engines.fleet.http_errors import ResponseTooLargeError

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "BoundedBody", "bounded_lines"]

DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20
"""64 MiB. The largest answer an engine gives is a ``/generate`` of a whole context: about 30
bytes a token as JSON ids and log-probs (twice that streamed, where the last record repeats the
output), so 64 MiB holds a million generated tokens, far past any context length served today."""

SETTING = "EngineHTTPClient(max_response_bytes=...)"


class BoundedBody:
    """Counts the bytes of one answer against a limit.

    Args:
        limit: The most bytes accepted.
        what: Names the request in errors (``POST http://host:8000/generate``).
    """

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.received = 0

    def check_headers(self, headers: Any) -> None:
        """Refuse an answer by its headers: a compressed one, or a ``Content-Length`` over the limit.

        Raises:
            ResponseTooLargeError: on either.
        """
        encoding = (headers.get("content-encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise ResponseTooLargeError(
                f"{self.what}: the answer is compressed (Content-Encoding: {encoding[:40]}), which the client asked "
                "not to get and refuses (its size is unknown until inflated); is a proxy in between compressing it?")
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            raise self.too_large(f"it declares Content-Length: {int(length)}")

    def add(self, chunk: bytes) -> bytes:
        """Count ``chunk`` and hand it back.

        Raises:
            ResponseTooLargeError: once more than ``limit`` bytes have arrived.
        """
        self.received += len(chunk)
        if self.received > self.limit:
            raise self.too_large(f"more than {self.limit} bytes arrived")
        return chunk

    def too_large(self, seen: str) -> ResponseTooLargeError:
        return ResponseTooLargeError(
            f"{self.what}: the answer is over the client's limit of {self.limit} bytes ({seen}); the connection was "
            f"dropped. An engine's answer is far smaller: is the URL an agentloop engine server? If it is, raise "
            f"{SETTING}")

    async def read(self, chunks: AsyncIterator[bytes]) -> bytes:
        """The whole body of ``chunks`` (a response's raw bytes), within the limit."""
        out = bytearray()
        async for chunk in chunks:
            out += self.add(chunk)
        return bytes(out)

    def read_sync(self, chunks: Iterator[bytes]) -> bytes:
        """:meth:`read` for a blocking response."""
        out = bytearray()
        for chunk in chunks:
            out += self.add(chunk)
        return bytes(out)


async def bounded_lines(chunks: AsyncIterator[bytes], body: BoundedBody) -> AsyncIterator[str]:
    """The lines of a streamed body (newline-delimited JSON), counted against ``body``'s limit.

    A line is held only until its newline: a server that never sends one is cut at the limit
    like any other over-long answer.
    """
    pending = bytearray()
    async for chunk in chunks:
        pending += body.add(chunk)
        while True:
            end = pending.find(b"\n")
            if end < 0:
                break
            line = bytes(pending[:end])
            del pending[: end + 1]
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield bytes(pending).decode("utf-8", errors="replace")
