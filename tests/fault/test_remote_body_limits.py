"""EngineHTTPClient against a hostile engine server: answers that never end.

A raw TCP server on 127.0.0.1 answers every HTTP request with a body of hundreds of megabytes
(chunked, or behind a ``Content-Length`` it never honours): as a ``/generate`` answer, a
streamed one (one line without end, or valid delta records without end), ``/health``, a 500
page, a control route's answer, and a few hundred kilobytes of gzip that inflate to 256 MiB.
EngineHTTPClient must read at most ``max_response_bytes`` of it, drop the connection and raise
``ResponseTooLargeError`` (a ``EngineHTTPError``) naming the limit and the setting, with the
client's memory bounded by the limit (measured with tracemalloc) instead of the body.

Before the limit, EngineHTTPClient read every answer whole (``response.json()``): the 160 MiB
answer below cost more than 300 MiB and ended in a JSON error, and an endless one would have
filled the trainer's memory. If one of these fails, read ``agentloop_engines.fleet.http_body``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("httpx", reason='EngineHTTPClient needs pip install "agentloop-engines[server]"')

from agentloop_engines.fleet.http_body import DEFAULT_MAX_RESPONSE_BYTES  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient, EngineHTTPError, ResponseTooLargeError  # noqa: E402

MIB = 2**20
CHUNK = 64 * 1024
JSON_FILLER = b" " * CHUNK  # whitespace: valid JSON padding, so only its size can fail it
RECORD = b'{"token_ids":[1],"log_probs":null}\n'
HEALTHY = (b'{"status":"ok","capabilities":{"vision":false},"images":{"accepted":false,"reason":"text"},'
           b'"max_model_len":64,"vocab_size":100}')


class HostileServer:
    """Answers every request on 127.0.0.1 with ``status`` and a body of ``total`` bytes of
    ``filler`` (chunked, or with ``content_length`` declared); ``/health`` as told by ``health``.

    ``sent`` counts the body bytes the server managed to write before the client hung up.
    """

    def __init__(self, *, filler: bytes = JSON_FILLER, total: int = 256 * MIB, status: int = 200,
                 content_length: int | None = None, headers: tuple[str, ...] = (), health: bytes | None = HEALTHY,
                 body: bytes | None = None) -> None:
        self.filler, self.total, self.status = filler, total, status
        self.content_length, self.headers, self.health, self.body = content_length, headers, health, body
        self.sent = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def __enter__(self) -> HostileServer:
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    path = self._read_request(conn)
                    if path is None:
                        return
                    if path == "/health" and self.health is not None:
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                     + str(len(self.health)).encode() + b"\r\n\r\n" + self.health)
                        continue
                    self._flood(conn)
                    return
            except OSError:
                return  # the client hung up: what it should do

    @staticmethod
    def _read_request(conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return None
            data += more
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(rest) < length:
            more = conn.recv(65536)
            if not more:
                return None
            rest += more
        return head.split(b" ")[1].decode()

    def _flood(self, conn: socket.socket) -> None:
        head = [f"HTTP/1.1 {self.status} X", "content-type: application/json", *self.headers]
        chunked = self.content_length is None and self.body is None
        if self.body is not None:
            head.append(f"content-length: {len(self.body)}")
        elif chunked:
            head.append("transfer-encoding: chunked")
        else:
            head.append(f"content-length: {self.content_length}")
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        if self.body is not None:
            conn.sendall(self.body)
            self.sent += len(self.body)
            return
        frame = (f"{len(self.filler):x}\r\n".encode() + self.filler + b"\r\n") if chunked else self.filler
        while self.sent < self.total and not self._stop.is_set():
            conn.sendall(frame)
            self.sent += len(self.filler)
        if chunked:
            conn.sendall(b"0\r\n\r\n")


@pytest.fixture
def peak() -> Iterator[Any]:
    """``peak()``: the most memory Python held (tracemalloc) since the test began, in bytes."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def assert_clean_limit_error(exc: BaseException, limit: int) -> None:
    assert isinstance(exc, ResponseTooLargeError)
    assert isinstance(exc, EngineHTTPError)
    message = str(exc)
    assert f"limit of {limit} bytes" in message
    assert "EngineHTTPClient(max_response_bytes=...)" in message
    assert len(message) < 600


async def call(server: EngineHTTPClient, what: str) -> Any:
    if what == "generate":
        return await server.generate("r", [1, 2, 3], {"max_tokens": 4})
    if what == "generate_stream":
        return [d async for d in server.generate_stream("r", [1, 2, 3], {"max_tokens": 4})]
    if what == "abort":
        return await server.abort("r")
    if what == "connect":
        return await server.connect()
    raise AssertionError(what)


@pytest.mark.parametrize(("what", "server_kwargs"), [
    pytest.param("generate", {}, id="generate-chunked"),
    pytest.param("generate", {"status": 500}, id="generate-500-page"),
    pytest.param("generate_stream", {"filler": b"x" * CHUNK}, id="stream-one-endless-line"),
    pytest.param("generate_stream", {"filler": RECORD * (CHUNK // len(RECORD))}, id="stream-endless-records"),
    pytest.param("generate_stream", {"status": 400}, id="stream-400-page"),
    pytest.param("abort", {}, id="control-route"),
    pytest.param("connect", {"health": None}, id="health"),
])
async def test_an_endless_answer_is_cut_at_the_limit_with_bounded_memory(what, server_kwargs, peak):
    limit = 1 * MIB
    with HostileServer(**server_kwargs) as hostile:
        remote = EngineHTTPClient(hostile.url, control_key="c", max_response_bytes=limit)
        try:
            with pytest.raises(EngineHTTPError) as caught:
                await call(remote, what)
        finally:
            await remote.close()
        assert_clean_limit_error(caught.value, limit)
        assert peak() < 8 * MIB  # the body was 256 MiB
        await asyncio.sleep(0.2)
        # The client hung up: the server could not write much past the limit (socket buffers).
        assert hostile.sent < limit + 32 * MIB, hostile.sent


async def test_the_default_limit_cuts_a_160_mib_answer_and_memory_stays_near_the_limit(peak):
    with HostileServer(total=160 * MIB) as hostile:
        remote = EngineHTTPClient(hostile.url)
        try:
            with pytest.raises(EngineHTTPError) as caught:
                await remote.generate("r", [1, 2, 3], {"max_tokens": 4})
        finally:
            await remote.close()
    assert_clean_limit_error(caught.value, DEFAULT_MAX_RESPONSE_BYTES)
    assert "max_response_bytes" in str(caught.value)
    # 64 MiB held at most (with bytearray's growth margin); before, the whole answer and its parse.
    assert peak() < DEFAULT_MAX_RESPONSE_BYTES + 32 * MIB, peak()


async def test_a_declared_content_length_over_the_limit_is_refused_before_reading(peak):
    with HostileServer(content_length=10**12, total=64 * MIB) as hostile:
        remote = EngineHTTPClient(hostile.url, max_response_bytes=MIB)
        try:
            with pytest.raises(ResponseTooLargeError, match="Content-Length: 1000000000000") as caught:
                await remote.generate("r", [1], {})
        finally:
            await remote.close()
    assert_clean_limit_error(caught.value, MIB)
    assert peak() < 8 * MIB


async def test_a_compressed_answer_is_refused_unread(peak):
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    zeros = b"0" * MIB
    bomb = b"".join(deflate.compress(zeros) for _ in range(256)) + deflate.flush()  # 256 MiB in ~250 KB
    assert len(bomb) < MIB
    with HostileServer(body=bomb, headers=("content-encoding: gzip",)) as hostile:
        remote = EngineHTTPClient(hostile.url, max_response_bytes=64 * MIB)
        try:
            with pytest.raises(ResponseTooLargeError, match=r"compressed \(Content-Encoding: gzip\)"):
                await remote.generate("r", [1], {})
        finally:
            await remote.close()
    assert peak() < 8 * MIB


def test_the_blocking_health_read_outside_an_event_loop_is_bounded_too(peak):
    with HostileServer(health=None) as hostile:
        remote = EngineHTTPClient(hostile.url, max_response_bytes=MIB)
        with pytest.raises(ResponseTooLargeError) as caught:
            _ = remote.capabilities
    assert_clean_limit_error(caught.value, MIB)
    assert peak() < 8 * MIB


async def test_an_answer_within_the_limit_is_read_as_before():
    answer = b'{"token_ids":[5,6],"log_probs":[-0.5,-0.25],"stop_reason":"length","instance":"i1"}'
    answer = answer.ljust(len(HEALTHY))  # both answers exactly at the limit
    with HostileServer(body=answer) as hostile:
        async with EngineHTTPClient(hostile.url, max_response_bytes=len(HEALTHY)) as remote:
            out = await remote.generate("r", [1], {})
    assert out.token_ids == [5, 6]
    assert out.log_probs == [-0.5, -0.25]
    assert out.extra == {"engine_instance": "i1"}
