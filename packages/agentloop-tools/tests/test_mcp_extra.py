"""The MCP module without its extra: importable, and a clear ImportError on use."""

import subprocess
import sys

import pytest

from agentloop_tools.mcp import load_mcp_tools


def test_missing_fastmcp_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastmcp", None)  # makes `import fastmcp` raise ImportError
    with pytest.raises(ImportError, match=r'pip install "agentloop-tools\[mcp\]"'):
        load_mcp_tools({"mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp", "connect_retries": 1}}})


def test_importing_tools_does_not_import_fastmcp_or_torch():
    code = (
        "import sys, agentloop_tools.mcp, agentloop_tools.load_tools, agentloop_tools.builtin\n"
        "print(sorted(m for m in ('fastmcp', 'torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
