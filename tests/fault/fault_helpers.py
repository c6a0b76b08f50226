"""Helpers shared by the fault tests (imported as ``fault_helpers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from agentloop_core.testing import ScriptedServer


def tool_call(name: str, **arguments: Any) -> str:
    """A hermes-format tool call, as the model would write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_engine(tokenizer: Any, turns: Callable[[str, int], str], **kw: Any) -> ScriptedServer:
    """An engine that says ``turns(request_id, call_index)`` then EOS: the request id (set per
    dataset row) decides which tool a trajectory calls."""

    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns(request_id, index), add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True, **kw)


def tool_messages(output: Any) -> list[str]:
    """Contents of the tool messages the model read in one trajectory."""
    return [m["content"] for m in output.extra_fields["messages"] if m["role"] == "tool"]




def run_killed_script(tmp_path: Any, source: str, root: Any) -> None:
    """Run ``source`` (a script that SIGKILLs itself mid-write) on ``root`` in a subprocess and
    check that it did die by SIGKILL, so the test really interrupted what it meant to."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def read_response(sock: Any) -> bytes:
    """Everything a server sends on ``sock`` until it closes the connection or has answered one
    whole response (Content-Length); a read past the socket's timeout raises ``socket.timeout``."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(rest) >= length:
                return data


MCP_CLIENT = textwrap.dedent('''
    import asyncio, json, resource, sys
    from agentloop_tools.mcp import MCPToolset, parse_mcp_servers

    config, calls = json.loads(sys.argv[1]), json.loads(sys.argv[2])

    async def main():
        toolset = MCPToolset(parse_mcp_servers(config)[0])
        await toolset.list_tools()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        results = []
        for n in calls:
            response, metrics = await toolset.call_tool("big", {"n": n})
            results.append({"n": n, "text_len": len(response.text or ""), "head": (response.text or "")[:300],
                            "metrics": metrics})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        await toolset.aclose()
        print(json.dumps({"results": results, "rss_growth_mb": (after - before) / 1024}))

    asyncio.run(main())
''')


def run_mcp_client(config: dict[str, Any], calls: list[int], *, timeout_s: float) -> dict[str, Any]:
    """Call the ``big`` tool of the MCP server ``config`` names once per entry of ``calls`` (its
    ``n``) from a fresh process: each result's length, head and metrics, and the process's peak
    RSS growth over the calls (``rss_growth_mb``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", MCP_CLIENT, json.dumps(config), json.dumps(calls)],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
