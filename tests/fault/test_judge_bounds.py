"""The judge client reads at most ``max_response_bytes`` from the judge server: it read every
answer whole (``response.json()`` of the full body), so a judge URL that points at the wrong
thing, or a hostile server, could make each rollout worker hold hundreds of MB per call (eight
calls in flight by default), and a body that never ends grew it until the call timed out.

The server is a scripted one on 127.0.0.1 (``http.server`` in a thread) that sends 200 MB with a
Content-Length, 512 MB without one, or a gzip body though asked for none; the client's Python
allocations are traced (``tracemalloc``) while it judges.

How to debug a failure: the bound is ``JudgeClient._read_bounded`` (``reward/judge_client.py``);
a traced peak of hundreds of MB means the body was read whole again (``client.post`` instead of
``client.stream``); a message without ``max_response_bytes`` means another error came first.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentloop_trainer.reward.judge import JudgeSettings
from agentloop_trainer.reward.judge_client import DEFAULT_MAX_RESPONSE_BYTES, JudgeClient, JudgeFailed

MB = 1 << 20


def _reply(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()


class HostileJudge:
    """``/v1/chat/completions`` on 127.0.0.1 answering in the given ``mode``; ``sent`` counts
    the bytes it got out before the client hung up."""

    def __init__(self, mode: str) -> None:
        self.mode, self.sent = mode, 0
        # 64 KB on the wire that is a whole valid reply... of 64 MB once expanded (made here,
        # before the client's allocations are traced).
        self.gzip_body = gzip.compress(_reply("Score: 7" + " " * (64 * MB))) if mode == "gzip" else b""
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client refused the rest
                    judge.answer(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if self.mode == "gzip":
            body = self.gzip_body
            handler.send_header("Content-Encoding", "gzip")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        if self.mode == "small":
            body = _reply("Score: 7 " + "y" * 3000)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        total = 200 * MB if self.mode == "200 MB with length" else 512 * MB
        if self.mode == "200 MB with length":
            handler.send_header("Content-Length", str(total))
        else:
            handler.send_header("Connection", "close")  # the body ends when the connection does
        handler.end_headers()
        chunk = b'{"choices": [{"message": {"content": "' + b"x" * MB
        while self.sent < total:
            handler.wfile.write(chunk)
            self.sent += len(chunk)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile() -> Iterator[list[HostileJudge]]:
    started: list[HostileJudge] = []
    yield started
    for judge in started:
        judge.close()


def _judge(url: str, **client: int) -> tuple[BaseException | None, int]:
    """Judge once (no retries, a minute's timeout: the limit, not the clock, must stop it);
    the error and the traced peak of Python allocations in bytes."""
    judge_client = JudgeClient(JudgeSettings(url=url, retries=0, timeout_s=60.0), **client)
    tracemalloc.start()
    try:
        asyncio.run(judge_client.judge("grade this", tokenizer=None))
        error = None
    except JudgeFailed as exc:
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


@pytest.mark.parametrize("mode", ["200 MB with length", "512 MB without length", "gzip"])
def test_a_judge_server_cannot_make_the_client_read_more_than_the_limit(hostile, mode):
    """Each hostile answer fails the judgement with an error naming max_response_bytes, and the
    client's traced peak stays under 16 MB (limit 4 MiB; before: the whole body, 200-512 MB, or
    the 64 MB the gzip body expands to)."""
    judge = HostileJudge(mode)
    hostile.append(judge)
    error, peak = _judge(judge.url)
    assert error is not None, f"{mode}: the judgement succeeded"
    assert "max_response_bytes" in str(error), str(error)
    assert f"{DEFAULT_MAX_RESPONSE_BYTES:,}" in str(error), str(error)
    assert "JudgeResponseTooLargeError" in str(error), str(error)
    assert peak < 16 * MB, f"{mode}: the client's allocations peaked at {peak / MB:.0f} MB"


def test_the_limit_is_a_setting(hostile):
    """A 3 KB reply passes under the default and fails under ``max_response_bytes=2048``."""
    judge = HostileJudge("small")
    hostile.append(judge)
    error, _ = _judge(judge.url)
    assert error is None, error
    error, _ = _judge(judge.url, max_response_bytes=2048)
    assert error is not None
    assert "max_response_bytes=2,048" in str(error), error
