"""An MCP server run as a subprocess (stdio) is bounded by ``max_result_bytes`` like an HTTP one:
the MCP SDK's stdio client joined the server's stdout into one string until a newline came, so a
200 MB result was held whole and then parsed (the client grew ~5x the result), and a result that
never ends grew the client until it was killed.

The server here is a raw JSON-RPC script (no SDK), so it can put the request id first (as the
Python SDK and fastmcp do) or last (as the TypeScript SDK does), and can send a line that never
ends. The client runs in a fresh process: its peak RSS is the measure.

How to debug a failure: the bound is ``agentloop_tools.mcp_stdio.bounded_stdio_client``, built by
``MCPToolset._make_client`` for a ``command`` server. A growth of hundreds of MB means the SDK's
own ``StdioTransport`` was used; a ``ConnectionError`` on the call after the big one means the
toolset did not reopen the connection the cut closed (``_is_error_response`` /
``call_tool``); a call that hangs means the error did not reach the waiting request (its id).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fault_helpers import run_mcp_client

pytest.importorskip("fastmcp", reason='MCP fault tests need fastmcp: pip install "agentloop-tools[mcp]"')

MB = 1 << 20

SERVER = r'''
import json, sys

mode = sys.argv[1]  # "id-first" or "id-last"
out = sys.stdout

def send(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()

for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": msg["params"]["protocolVersion"],
              "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [{"name": "big", "description": "n bytes (-1: endless)",
              "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}}]}})
    elif method == "tools/call":
        n = msg["params"]["arguments"]["n"]
        if mode == "id-first":
            out.write('{"jsonrpc": "2.0", "id": %s, "result": {"content": [{"type": "text", "text": "' % json.dumps(mid))
        else:
            out.write('{"result": {"content": [{"type": "text", "text": "')
        chunk, sent = "x" * MB_, 0
        while n < 0 or sent < n:
            part = chunk if n < 0 else chunk[:min(len(chunk), n - sent)]
            out.write(part)
            sent += len(part)
        out.write('"}]}}\n' if mode == "id-first" else '"}]}, "jsonrpc": "2.0", "id": %s}\n' % json.dumps(mid))
        out.flush()
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
'''.replace("MB_", str(MB))


def _client(tmp_path: Path, mode: str, calls: list[int], **server: object) -> dict:
    script = tmp_path / "stdio_server.py"
    script.write_text(SERVER)
    config = {"mcpServers": {"hostile": {"command": sys.executable, "args": [str(script), mode],
                                         "connect_retries": 2, "timeout_s": 60, **server}}}
    return run_mcp_client(config, calls, timeout_s=240)


def _assert_cut(result: dict, limit: str = "8,388,608 bytes") -> None:
    assert result["text_len"] < 1000, result
    assert result["head"].startswith("Error:"), result
    assert "max_result_bytes" in result["head"], result
    assert limit in result["head"], result
    assert result["metrics"]["mcp_result_too_large"] == 1, result
    assert result["metrics"]["mcp_is_error"] is True, result


def _assert_intact(result: dict, n: int) -> None:
    assert result["text_len"] == n, result
    assert not result["metrics"]["mcp_is_error"], result
    assert "mcp_result_too_large" not in result["metrics"], result


def test_a_200_mb_and_an_endless_stdio_result_are_cut_at_the_byte_limit(tmp_path):
    """A small result, 200 MB, a small one, a line that never ends, a small one: the big ones
    come back as the error the model reads naming max_result_bytes (mcp_result_too_large=1), the
    small ones intact (the connection the cut closed is reopened); the client grows by under
    64 MB (8 MiB limit; before: ~1 GB for the 200 MB, and the endless line grew it unbounded)."""
    out = _client(tmp_path, "id-first", [1000, 200 * MB, 1000, -1, 1000])
    small, big, after_big, endless, after_endless = out["results"]
    _assert_intact(small, 1000)
    _assert_cut(big)
    _assert_intact(after_big, 1000)
    _assert_cut(endless)
    _assert_intact(after_endless, 1000)
    assert out["rss_growth_mb"] < 64, f"the client grew by {out['rss_growth_mb']:.0f} MB"


def test_a_result_with_its_id_at_the_end_is_still_attributed_to_its_call(tmp_path):
    """A server that writes the id after the result (the TypeScript SDK's order): the one call
    in flight gets the error, with the limit set to 2 MiB on 3 MB."""
    out = _client(tmp_path, "id-last", [3 * MB, 1000], max_result_bytes=2 * MB)
    big, small = out["results"]
    _assert_cut(big, "2,097,152 bytes")
    _assert_intact(small, 1000)


def test_null_lifts_the_limit_for_a_trusted_stdio_server(tmp_path):
    """``max_result_bytes: null`` (the documented opt-out) passes 3 MB whole over stdio."""
    out = _client(tmp_path, "id-first", [3 * MB], max_result_bytes=None)
    _assert_intact(out["results"][0], 3 * MB)


def test_line_splitter_holds_at_most_the_limit_and_reads_the_request_id():
    """Lines split across chunks come out whole; a line over the limit is reported with its
    head, without waiting for its end; the id at the start is read whether a number or a string."""
    from agentloop_tools.mcp_stdio import LineSplitter, request_id_at_start

    splitter = LineSplitter(limit=10)
    assert splitter.feed(b"abc\nde") == ([b"abc"], None)
    assert splitter.feed(b"f\n0123456789\n") == ([b"def", b"0123456789"], None)
    lines, over = splitter.feed(b"x" * 11)
    assert lines == []
    assert over == b"x" * 11
    assert request_id_at_start(b'{"jsonrpc": "2.0", "id": 7, "result": {"content": "xx') == 7
    assert request_id_at_start(b'{"id":"a\\"b","jsonrpc":"2.0"') == 'a"b'
    assert request_id_at_start(b'{"result": {"id": 3}') is None
