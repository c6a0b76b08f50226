"""The byte limit on what EngineHTTPClient reads (``agentloop_engines.fleet.http_body``), piece by piece:
the setting, the counting, the header checks, and the line splitter of streamed answers.
The whole path against a hostile server on 127.0.0.1 is ``tests/fault/test_remote_body_limits.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason='EngineHTTPClient needs pip install "agentloop-engines[server]"')

from agentloop_engines.fleet.http_body import DEFAULT_MAX_RESPONSE_BYTES, BoundedBody, bounded_lines  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient, EngineHTTPError, ResponseTooLargeError  # noqa: E402


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64"])
def test_max_response_bytes_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_response_bytes must be a positive integer"):
        EngineHTTPClient("http://127.0.0.1:1", max_response_bytes=bad)


def test_the_default_is_64_mib_and_asks_for_uncompressed_answers():
    server = EngineHTTPClient("http://127.0.0.1:1")
    assert server.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 64 * 2**20
    assert server._headers["Accept-Encoding"] == "identity"


def test_bytes_are_counted_up_to_the_limit_and_refused_past_it():
    body = BoundedBody(10, "POST http://h/generate")
    assert body.add(b"12345") == b"12345"
    assert body.add(b"67890") == b"67890"  # exactly at the limit
    with pytest.raises(ResponseTooLargeError) as caught:
        body.add(b"x")
    assert isinstance(caught.value, EngineHTTPError)
    assert "POST http://h/generate" in str(caught.value)
    assert "limit of 10 bytes" in str(caught.value)
    assert "EngineHTTPClient(max_response_bytes=...)" in str(caught.value)


@pytest.mark.parametrize(("headers", "match"), [
    ({"content-length": "11"}, "Content-Length: 11"),
    ({"content-encoding": "gzip"}, "compressed"),
    ({"content-encoding": "br", "content-length": "3"}, "compressed"),
])
def test_an_answer_is_refused_from_its_headers(headers, match):
    with pytest.raises(ResponseTooLargeError, match=match):
        BoundedBody(10, "GET x").check_headers(headers)


@pytest.mark.parametrize("headers", [{}, {"content-length": "10"}, {"content-encoding": "identity"},
                                     {"content-length": "not a number"}])
def test_a_plain_answer_within_the_limit_passes_the_header_check(headers):
    BoundedBody(10, "GET x").check_headers(headers)


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


async def test_lines_split_across_chunks_are_joined_and_a_last_line_without_newline_is_kept():
    body = BoundedBody(1000, "POST x")
    text = "é".encode()
    lines = [line async for line in bounded_lines(_chunks(b'{"a":', b'1}\n{"b"', b":2}\n\n" + text[:1], text[1:]), body)]
    assert lines == ['{"a":1}', '{"b":2}', "", "é"]
    assert body.received == len(b'{"a":1}\n{"b":2}\n\n') + len(text)


async def test_a_stream_of_short_lines_is_cut_at_the_total_limit():
    body = BoundedBody(100, "POST x")
    got: list[str] = []

    async def read_all() -> None:
        async for line in bounded_lines(_chunks(*[b"0123456789\n"] * 50), body):
            got.append(line)

    with pytest.raises(ResponseTooLargeError):
        await read_all()
    assert len(got) == 9  # 99 bytes read, the 10th line pushed past 100
