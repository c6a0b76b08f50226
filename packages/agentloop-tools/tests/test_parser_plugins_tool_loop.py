"""``tool_agent`` with a tool-call parser installed only as a plug-in (an entry point in
``agentloop.tool_parsers``, a real dist-info on ``sys.path``): named in the loop's config like a
built-in parser, it finds the call, the tool runs and its result reaches the next turn.

A failure at construction means the loop no longer resolves parsers through the registry that
reads the entry points; a failure in the counts means the plug-in's parse is not the one used.
"""

from __future__ import annotations

import json

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.plugin_dist import installed_parser_plugins
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.function_tool import function_tool

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


@function_tool
def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: First number.
        b: Second number.
    """
    return str(a + b)


@pytest.fixture
def plugin(tmp_path):
    with installed_parser_plugins(tmp_path) as root:
        yield root


async def test_tool_agent_runs_the_calls_an_installed_parser_finds(plugin):
    tok = load_tiny_tokenizer()
    turns = [f'Let me add.\n<call>{json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}})}</call>', "It is 7."]
    server = ScriptedServer(lambda rid, prompt, i: tok.encode(turns[min(i, 1)], add_special_tokens=False),
                            eos_token_id=tok.eos_token_id, append_eos=True, vocab_size=len(tok))
    loop = ToolAgentLoop(server, tok, {"tools": {"add": add}, "tool_parser": "demo_angle", "response_length": 512})
    assert loop.parser.name == "demo_angle"
    out = await loop.run({"temperature": 0.0}, raw_prompt=PROMPT, request_id="r")
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 0
    assert [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"] == ["7"]
    assert out.extra_fields["termination_reason"] == "no_tool_call"
