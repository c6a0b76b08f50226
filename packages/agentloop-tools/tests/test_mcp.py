"""MCP tools against a real fastmcp server over streamable HTTP on 127.0.0.1 (and stdio)."""

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import types
from typing import Any

import pytest

pytest.importorskip("fastmcp", reason='MCP tests need fastmcp: pip install "agentloop-tools[mcp]"')

from agentloop_tools import mcp, mcp_config  # noqa: E402
from agentloop_tools.load_tools import load_tools  # noqa: E402
from agentloop_tools.mcp import MCPTool, MCPToolset, Secret, TokenBucket, load_mcp_tools, parse_mcp_servers  # noqa: E402

TOKEN = "tok-9f8e7d6c5b4a-secret"

SERVER = '''
import sys, time
from fastmcp import FastMCP

mcp = FastMCP("agentloop-test")

@mcp.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@mcp.tool
def boom(x: str) -> str:
    """Always fails."""
    raise ValueError("bad input " + x)

@mcp.tool
def stamp() -> float:
    """Server time of the call."""
    return time.monotonic()

if sys.argv[1] == "stdio":
    mcp.run(transport="stdio", show_banner=False)
else:
    import uvicorn
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse

    class RequireBearer:
        """Rejects every HTTP request without the expected bearer token."""
        def __init__(self, app, token):
            self.app, self.expected = app, f"Bearer {token}".encode()
        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
                return await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
            await self.app(scope, receive, send)

    app = mcp.http_app(path="/mcp", middleware=[Middleware(RequireBearer, token=sys.argv[3])])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="error")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(path, port):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, str(path), "http", str(port), TOKEN],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(textwrap.dedent(SERVER))
    return path


@pytest.fixture(scope="module")
def server_url(server_script):
    port = _free_port()
    proc = _start_server(server_script, port)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    else:
        _stop(proc)
        pytest.fail("fastmcp test server did not start within 30 s")
    yield url
    _stop(proc)


def _config(url, **extra):
    return {"mcpServers": {"test": {"url": url, "transport": "http", "auth_token": TOKEN, **extra}}}


async def test_list_and_call_tools(server_url):
    tools = load_mcp_tools(_config(server_url))  # from inside a running loop: lists on a helper thread
    assert sorted(tools) == ["add", "boom", "stamp"]
    add = tools["add"]
    assert isinstance(add, MCPTool)
    params = add.tool_schema.function.parameters
    assert params.required == ["a", "b"]
    assert params.properties["a"] == {"type": "integer"}
    iid = await add.create()
    resp, reward, metrics = await add.execute(iid, {"a": 2, "b": 40})
    assert (resp.text, reward, metrics["mcp_is_error"]) == ("42", 0.0, False)
    # A tool error on the server is text for the model, not an exception.
    boom = tools["boom"]
    iid2 = await boom.create()
    resp, _, metrics = await boom.execute(iid2, {"x": "q"})
    assert metrics["mcp_is_error"]
    assert resp.text.startswith("Error")
    assert "bad input q" in resp.text
    await add.toolset.aclose()


async def test_tool_selected_list_and_yaml_config(server_url, tmp_path):
    (tmp_path / "servers.json").write_text(json.dumps({"mcpServers": {"test": {"url": server_url, "auth_token": TOKEN}}}))
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - config: {type: mcp, timeout_s: 9}\n    mcp:\n"
        "      mcp_servers_config_path: servers.json\n      tool_selected_list: [add]\n"
    )
    tools = load_tools(tmp_path / "tools.yaml")
    assert list(tools) == ["add"]
    assert tools["add"].timeout_s == 9.0
    with pytest.raises(ValueError, match=r"names \['nope'\], which the server does not offer"):
        load_mcp_tools(_config(server_url), tool_selected_list=["nope"])


class FrozenClock:
    """Stands in for the ``time`` module of :mod:`agentloop_tools.mcp_config`: the token bucket
    sees no time pass unless a test calls :meth:`advance`, so the waits it hands out are exact.
    The waiting itself (``asyncio.sleep``) still runs on the real clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def frozen_clock(monkeypatch):
    clock = FrozenClock()
    monkeypatch.setattr(mcp_config, "time", clock)
    return clock


async def test_rate_limit_spaces_calls(server_url, frozen_clock):
    rate = 10.0
    tools = load_mcp_tools(_config(server_url, rate_limit=rate))
    stamp = tools["stamp"]
    iid = await stamp.create()
    first = await stamp.execute(iid, {})  # warm the connection; consumes the burst token
    assert first[2]["mcp_rate_wait_s"] == 0.0
    results = await asyncio.wait_for(asyncio.gather(*(stamp.execute(iid, {}) for _ in range(5))), 60)
    # Token bucket with burst 1: each concurrent call waits for its own slot, 1/rate after the last.
    waits = sorted(r[2]["mcp_rate_wait_s"] for r in results)
    assert waits == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5]), waits
    assert all(not r[2]["mcp_is_error"] for r in results)
    await stamp.toolset.aclose()


class SleepLog(types.ModuleType):
    """``asyncio`` as :mod:`agentloop_tools.mcp` sees it, with the delay of every sleep recorded."""

    def __init__(self) -> None:
        super().__init__("asyncio")
        self.delays: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float, result: Any = None) -> Any:
        self.delays.append(delay)
        return await asyncio.sleep(delay, result)


async def test_server_down_retries_then_clear_error(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="agentloop_tools.mcp")
    sleeps = SleepLog()
    monkeypatch.setattr(mcp, "asyncio", sleeps)
    port = _free_port()
    config = _config(f"http://127.0.0.1:{port}/mcp", connect_retries=3, retry_backoff_s=0.1)
    with pytest.raises(ConnectionError, match=r"could not connect after 3 attempts.*is the server running"):
        load_mcp_tools(config)
    attempts = [r.getMessage() for r in caplog.records if "connect attempt" in r.getMessage()]
    assert [a.split("connect attempt ")[1].split()[0] for a in attempts] == ["1/3", "2/3", "3/3"], attempts
    assert sleeps.delays == [0.1, 0.2]  # backoff doubles between attempts; no wait after the last


@pytest.mark.slow
async def test_retries_cover_a_server_that_is_still_starting(server_script):
    port = _free_port()
    config = _config(f"http://127.0.0.1:{port}/mcp", connect_retries=30, retry_backoff_s=0.25)
    task = asyncio.create_task(asyncio.to_thread(load_mcp_tools, config))
    await asyncio.sleep(0.5)
    proc = _start_server(server_script, port)  # starts after the first attempts failed
    try:
        tools = await asyncio.wait_for(task, timeout=60)
        assert "add" in tools
    finally:
        _stop(proc)


async def test_auth_required_and_token_never_shown(server_url, caplog):
    caplog.set_level(logging.DEBUG)
    no_token = {"mcpServers": {"test": {"url": server_url, "connect_retries": 2, "retry_backoff_s": 0.05}}}
    with pytest.raises(ConnectionError, match="check auth_token/headers"):
        load_mcp_tools(no_token)
    wrong = _config(server_url, connect_retries=1)
    wrong["mcpServers"]["test"]["auth_token"] = "wrong-token"
    with pytest.raises(ConnectionError) as err:
        load_mcp_tools(wrong)
    assert "wrong-token" not in str(err.value)

    tools = load_mcp_tools(_config(server_url, headers={"X-Api-Key": "hdr-secret-123"}))
    tool = tools["add"]
    iid = await tool.create()
    _, _, metrics = await tool.execute(iid, {"a": 1, "b": 1})
    server = tool.toolset.server
    shown = " ".join([repr(tool), repr(tool.toolset), repr(server), str(server), str(metrics), caplog.text])
    assert TOKEN not in shown
    assert "hdr-secret-123" not in shown
    assert isinstance(server.auth_token, Secret)
    assert server.auth_token.get() == TOKEN
    await tool.toolset.aclose()


@pytest.mark.slow
async def test_stdio_transport(server_script):
    config = {"mcpServers": {"local": {"command": sys.executable, "args": [str(server_script), "stdio"]}}}
    tools = load_mcp_tools(config)
    iid = await tools["add"].create()
    assert (await tools["add"].execute(iid, {"a": 3, "b": 4}))[0].text == "7"
    await tools["add"].toolset.aclose()


def test_config_validation():
    with pytest.raises(ValueError, match="exactly one of 'url'"):
        parse_mcp_servers({"mcpServers": {"a": {}}})
    with pytest.raises(ValueError, match=r"unknown keys \['token'\]"):
        parse_mcp_servers({"mcpServers": {"a": {"url": "http://x", "token": "t"}}})
    with pytest.raises(ValueError, match="transport 'stdio' does not fit"):
        parse_mcp_servers({"mcpServers": {"a": {"url": "http://x", "transport": "stdio"}}})
    with pytest.raises(ValueError, match="'mcpServers' mapping"):
        parse_mcp_servers({"servers": {}})
    server = parse_mcp_servers({"mcpServers": {"a": {"url": "http://u:pw@h:1/mcp?key=zz"}}})[0]
    assert server.display_url == "http://h:1/mcp"  # credentials and query never logged


async def test_token_bucket_spacing(frozen_clock):
    bucket = TokenBucket(rate=20, burst=2)
    waits = await asyncio.wait_for(asyncio.gather(*(bucket.acquire() for _ in range(6))), 60)
    # 2 free (burst), then each one 50 ms behind the one before.
    assert waits == pytest.approx([0.0, 0.0, 0.05, 0.10, 0.15, 0.20])
    frozen_clock.advance(60)  # a long idle spell refills the bucket, but only up to the burst
    assert await asyncio.wait_for(asyncio.gather(*(bucket.acquire() for _ in range(3))), 60) == pytest.approx(
        [0.0, 0.0, 0.05])
    # A caller that has to wait is really held back, not just told how long it should have waited.
    slow = TokenBucket(rate=0.01)
    assert await slow.acquire() == 0.0
    held = asyncio.create_task(slow.acquire())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not held.done(), "acquire() returned while the bucket was empty"
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    with pytest.raises(ValueError, match="rate > 0"):
        TokenBucket(rate=0)


def test_toolset_repr_hides_secrets():
    server = parse_mcp_servers({"mcpServers": {"a": {"url": "http://h/mcp", "auth_token": "abc123"}}})[0]
    assert "abc123" not in repr(MCPToolset(server))
    assert "abc123" not in repr(server)
