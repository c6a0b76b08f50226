"""Results from outside are bounded by bytes before they are parsed: an MCP server that answers
a tool call with 200 MB must not make the process hold 200 MB (it held ~10x that: the MCP client
read the body whole, then parsed it into pydantic models and Python strings, though the model
reads only ``max_tool_response_length`` characters of it).

The client runs in a fresh process (its peak RSS is the measure) against a fastmcp server on
127.0.0.1 in another, answering over streamable HTTP both as an event stream (fastmcp's
default) and as one JSON body (``json_response=True``).

How to debug a failure: the bound is the HTTP client that ``agentloop_tools.mcp_limits.
bounded_http_client_factory`` builds for ``MCPToolset._make_client``; a peak near 1-2 GB means the
factory was not passed to the transport, a ``ConnectionError`` means the MCP client did not turn
the cut-off into an error for the waiting call (see the exception's bases there).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import run_mcp_client

pytest.importorskip("fastmcp", reason='MCP fault tests need fastmcp: pip install "agentloop-tools[mcp]"')


BIG_SERVER = r'''
import sys
from fastmcp import FastMCP
import uvicorn

mcp = FastMCP("agentloop-big")

@mcp.tool
def big(n: int) -> str:
    """n bytes of text."""
    return "x" * n

port, json_response = int(sys.argv[1]), sys.argv[2] == "1"
uvicorn.run(mcp.http_app(path="/mcp", json_response=json_response), host="127.0.0.1", port=port, log_level="error")
'''

MB = 1 << 20


@pytest.fixture
def big_server(tmp_path: Path):
    """Factory: ``big_server(json_response) -> url`` of a fastmcp server in its own process
    group on 127.0.0.1; every server is killed at teardown."""
    script = tmp_path / "big_server.py"
    script.write_text(BIG_SERVER)
    started: list[subprocess.Popen] = []

    def start(json_response: bool) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen([sys.executable, str(script), str(port), "1" if json_response else "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        started.append(proc)
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return f"http://127.0.0.1:{port}/mcp"
            assert proc.poll() is None, "the MCP test server exited"
            assert time.monotonic() < deadline, "the MCP test server did not listen within 30 s"
            time.sleep(0.05)

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def _client(url: str, calls: list[int], **server: object) -> dict:
    config = {"mcpServers": {"big": {"url": url, "connect_retries": 3, "timeout_s": 120, **server}}}
    return run_mcp_client(config, calls, timeout_s=300)


@pytest.mark.parametrize("json_response", [False, True], ids=["event-stream", "json-body"])
def test_a_200_mb_result_is_cut_off_at_the_byte_limit_before_it_is_parsed(big_server, json_response):
    """A 200 MB result, then a small one on the same connection: the first comes back as an
    error the model reads naming max_result_bytes (mcp_result_too_large=1, mcp_is_error), the
    second intact; the client process grows by under 64 MB (8 MiB limit; it grew ~1 GB per 100 MB
    before)."""
    out = _client(big_server(json_response), [200 * MB, 1000])
    big, small = out["results"]
    assert big["text_len"] < 1000, big
    assert big["head"].startswith("Error:"), big
    assert "max_result_bytes" in big["head"], big
    assert big["metrics"]["mcp_result_too_large"] == 1
    assert big["metrics"]["mcp_is_error"] is True
    assert small["text_len"] == 1000, small
    assert not small["metrics"]["mcp_is_error"], small
    assert out["rss_growth_mb"] < 64, f"the client grew by {out['rss_growth_mb']:.0f} MB reading a 200 MB result"


def test_the_limit_is_per_server_and_can_be_lifted(big_server):
    """``max_result_bytes: 2 MiB`` cuts a 3 MB result and passes a 0.5 MB one (fastmcp sends a
    string twice, as text and as structured content); ``null`` (the documented opt-out for a
    trusted server) passes 3 MB whole."""
    url = big_server(False)
    limited = _client(url, [3 * MB, MB // 2], max_result_bytes=2 * MB)["results"]
    assert limited[0]["metrics"].get("mcp_result_too_large") == 1
    assert "2,097,152 bytes" in limited[0]["head"]
    assert limited[1]["text_len"] == MB // 2
    lifted = _client(url, [3 * MB], max_result_bytes=None)["results"]
    assert lifted[0]["text_len"] == 3 * MB
    assert "mcp_result_too_large" not in lifted[0]["metrics"]


def test_a_bad_max_result_bytes_is_a_config_error():
    """A limit under 1 KiB, a string or a bool is a ValueError naming the key."""
    from agentloop_tools.mcp_config import parse_mcp_servers

    for bad in (10, "big", True, -1):
        with pytest.raises(ValueError, match="max_result_bytes"):
            parse_mcp_servers({"mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp", "max_result_bytes": bad}}})
