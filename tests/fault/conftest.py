"""Shared fixtures of the fault-injection suite: the tiny tokenizer, one Ray cluster per
session, a fastmcp server in a subprocess, and a scripted engine that emits tool calls.

Every test here is marked ``fault`` (see ``pytest_collection_modifyitems``), so
``pytest -m fault`` selects the whole suite and ``-m "not fault"`` skips it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop_core.testing import load_tiny_tokenizer

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.fault)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return load_tiny_tokenizer()


# ---- Ray ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason='engine fault tests need Ray: pip install "agentloop-engines[ray]"')
    from agentloop_engines.fleet.hosting import init_local_ray

    init_local_ray(tmp_path_factory.mktemp("ray"))
    yield ray
    ray.shutdown()


# ---- a fastmcp server in a subprocess ----------------------------------------------------------

MCP_SERVER = r'''
import sys, time
from fastmcp import FastMCP

mcp = FastMCP("agentloop-fault")

@mcp.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

import uvicorn

port, token, max_calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
calls = {"n": 0}

class Gate:
    """Bearer auth, plus HTTP 429 for every tools/call after the first max_calls (a quota)."""
    def __init__(self, app):
        self.app = app
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if token and dict(scope["headers"]).get(b"authorization") != f"Bearer {token}".encode():
            return await _reply(send, 401, b'{"error": "unauthorized"}')
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if b'"tools/call"' in body:
            calls["n"] += 1
            if max_calls >= 0 and calls["n"] > max_calls:
                return await _reply(send, 429, b'{"error": "rate limit exceeded, retry later"}')
        sent = False
        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

async def _reply(send, status, body):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})

app = mcp.http_app(path="/mcp")
uvicorn.run(Gate(app), host="127.0.0.1", port=port, log_level="error")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MCPServerProcess:
    """A fastmcp streamable-HTTP server on 127.0.0.1 in its own process group."""

    def __init__(self, script: Path, token: str = "", max_calls: int = -1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.port), token, str(max_calls)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.proc.poll() is not None:
                raise RuntimeError(f"MCP test server exited: {self.proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("MCP test server did not listen within 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def mcp_server(tmp_path: Path) -> Iterator[Callable[..., MCPServerProcess]]:
    """Factory: ``mcp_server(token="...", max_calls=N)``; every server is killed at teardown."""
    pytest.importorskip("fastmcp", reason='MCP fault tests need fastmcp: pip install "agentloop-tools[mcp]"')
    script = tmp_path / "mcp_server.py"
    script.write_text(MCP_SERVER)
    started: list[MCPServerProcess] = []

    def start(**kw: Any) -> MCPServerProcess:
        server = MCPServerProcess(script, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
