"""A tool-call parser installed as a plug-in (entry point in ``agentloop.tool_parsers``, a real
dist-info on ``sys.path``) streams through the gateway like a built-in one: the gateway reads
what to hold back from the parser object (``ToolParser.call_openings``), so the content before
the call arrives token by token and the call arrives whole, equal to the non-streamed answer.

A failure where the content arrives as one piece means StreamText no longer reads the parser's
declared openings (the old name table knew only hermes and qwen3_coder). An engine that streams
a scripted reply one token at a time stands in for a model, since random weights write no calls.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.testing.plugin_dist import installed_parser_plugins
from agentloop_engines.serving.gateway import Gateway
from agentloop_engines.serving.gateway.live import stream_chat_completion
from agentloop_engines.serving.gateway.stream_text import StreamText
from agentloop_engines.testing.gateway_fixtures import StreamingScript

QUESTION = [{"role": "user", "content": "How many apples?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = json.dumps({"name": "calculator", "arguments": {"expression": "3 + 4"}})
REPLY = f"Let me work this out first.\n<call>{CALL}</call>"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture
def plugin(tmp_path):
    with installed_parser_plugins(tmp_path) as root:
        yield root


async def _whole_and_streamed(gateway: Gateway) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"model": "tiny", "messages": QUESTION, "tools": TOOLS}
    whole = (await gateway.chat_completion(body)).body
    chunks = [chunk async for chunk in await stream_chat_completion(gateway, {**body, "stream": True})]
    return whole, chunks


def test_an_installed_parser_streams_its_content_before_the_call(tokenizer, plugin):
    gateway = Gateway(StreamingScript(tokenizer, REPLY), tokenizer, tool_parser="demo_angle")
    whole, chunks = asyncio.run(_whole_and_streamed(gateway))
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me work this out first."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("calculator", {"expression": "3 + 4"})]

    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
    pieces = [d["content"] for d in deltas if d.get("content")]
    assert "".join(pieces) == message["content"]
    assert len(pieces) > 1, f"the content arrived whole, not as generated: {pieces}"
    assert not any("<" in p for p in pieces)  # no piece of the call's opening is ever sent
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert [{k: v for k, v in call.items() if k != "index"} for call in calls] == message["tool_calls"]
    assert [ch for ch in chunks if ch.get("choices")][-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_text_holds_back_only_the_openings_the_parser_declares(tokenizer, plugin):
    """Fed one token at a time, the content before ``<call>`` is sent while it is generated,
    with a parser that declares its opening; one that declares none gets its answer whole."""
    from agentloop_core.parsers import get_tool_parser

    ids = tokenizer.encode(REPLY, add_special_tokens=False)

    def pieces(parser_name: str) -> list[str]:
        stream = StreamText(lambda i: tokenizer.decode(list(i), skip_special_tokens=True), [],
                            parser=get_tool_parser(parser_name), tools={"calculator": TOOLS[0]},
                            format_calls=lambda parsed: [{"name": c.name} for c in parsed.calls])
        return [d["content"] for n in range(len(ids)) for d in stream.feed(ids[n:n + 1]) if "content" in d]

    sent = pieces("demo_angle")
    assert "".join(sent) == "Let me work this out first."
    assert len(sent) > 1
    assert pieces("llama3_json") == []  # no declared opening: nothing before the end (as before)
