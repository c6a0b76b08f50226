"""The Anthropic Messages API (``/v1/messages``) served by translating to the gateway's chat path.

The engine is a ScriptedServer replying with encoded text keyed by the prompt's last turn (or,
for token-by-token streams, a script streamed one token per delta); rendering (the tiny
tokenizer's ChatML template), tool-call parsing (hermes), reasoning parsing (qwen3) are real.
The first tests call :func:`create_message` on a Gateway; the last ones drive it with the
stock ``anthropic`` client over HTTP.

How to debug: a prompt-id mismatch against the chat path means the translation built other
chat messages than a chat client sends for the same conversation (print ``to_chat_body(body,
PromptLimits()).chat``); a continuation failure (``continued_calls`` 0) means the assistant
message sent back does not translate to the one the gateway returned (compare
``normalize_message`` of both); an SDK parse error means an event or field shape differs from
``anthropic.types``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from agentloop_engines.serving.gateway import Gateway
from agentloop_engines.serving.gateway.messages_api import anthropic_error_type, count_tokens, create_message
from agentloop_engines.serving.gateway.messages_request import to_chat_body
from agentloop_engines.serving.gateway.prompt_limits import PromptLimits
from agentloop_engines.testing.gateway_fixtures import StreamingScript, hermes_call

KEY = "gw-key"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.", "input_schema": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                                "parameters": SCHEMA}}]
QUESTION = "What is 3 + 4?"
THOUGHT = "<think>\nThree and four make seven.\n</think>\n\n"


def ask(text: str = QUESTION, **kwargs) -> dict:
    return {"model": "claude-test", "max_tokens": 64, "messages": [{"role": "user", "content": text}], **kwargs}


@pytest.fixture
def gateway(engine, tokenizer):
    return Gateway(engine, tokenizer, tool_parser="hermes", reasoning_parser="qwen3", model_name="tiny")


async def message(gateway: Gateway, body: dict, **kwargs: Any) -> dict[str, Any]:
    out = await create_message(gateway, body, **kwargs)
    assert isinstance(out, dict), "a body without stream: true gets the message object"
    return out


async def stream(gateway: Gateway, body: dict, **kwargs: Any) -> AsyncGenerator[dict[str, Any], None]:
    out = await create_message(gateway, {**body, "stream": True}, **kwargs)
    assert isinstance(out, AsyncGenerator), "a body with stream: true gets an iterator of events"
    return out


async def collect(events: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event async for event in events]


def assemble(events: list[dict]) -> list[dict]:
    """The content blocks the events build (as the SDK's accumulator does)."""
    blocks: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"], _json=""))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "_json",
                   "signature_delta": "signature"}[delta["type"]]
            field = {"text": "text", "thinking": "thinking", "_json": "partial_json", "signature": "signature"}[key]
            block[key] = block.get(key, "") + delta[field]
    for block in blocks:
        text = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(text)
    return blocks


# ---- non-streamed ----------------------------------------------------------------------


async def test_a_message_carries_text_usage_and_the_exact_tokens(gateway, engine, replies):
    """The message object has Anthropic's fields, and the engine's ids as extension fields."""
    replies.by_prompt["hi"] = ["Hello there."]
    m = await message(gateway, ask("hi", max_tokens=40))
    sent = engine.calls[0]
    assert m["id"].startswith("msg_")
    assert (m["type"], m["role"], m["model"]) == ("message", "assistant", "claude-test")
    assert m["content"] == [{"type": "text", "text": "Hello there."}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("end_turn", None)
    assert m["usage"] == {"input_tokens": len(sent.prompt_ids), "output_tokens": len(sent.output.token_ids),
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert m["prompt_token_ids"] == sent.prompt_ids
    assert m["token_ids"] == sent.output.token_ids
    assert m["token_logprobs"] == sent.output.log_probs
    assert sent.sampling_params.max_tokens == 40
    assert "session_id" not in m


async def test_one_conversation_renders_the_same_prompt_ids_as_chat(gateway, engine, tokenizer):
    """System, an assistant tool_use, a user turn holding the tool_result then text: the same
    prompt ids as the chat messages a chat client sends (tool message before the user text)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "3 + 4"})}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "7"},
            {"role": "user", "content": "And times two?"}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me compute."},
            {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {"expression": "3 + 4"}}]},
        {"role": "user", "content": [{"type": "text", "text": "And times two?"},
                                     {"type": "tool_result", "tool_use_id": "call_1", "content": "7"}]}]
    await gateway.chat_completion({"messages": chat, "tools": CHAT_TOOLS})
    body = {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}], "messages": messages,
            "tools": TOOLS}
    await message(gateway, body)
    expected = tokenizer.encode(tokenizer.apply_chat_template(chat, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False)
    assert engine.calls[0].prompt_ids == expected
    assert engine.calls[1].prompt_ids == expected
    counted = await count_tokens(gateway, {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted == {"input_tokens": len(expected)}
    assert len(engine.calls) == 2  # counting generates nothing


def test_blocks_translate_to_chat_messages():
    """Images become image_url parts, tool results tool messages (first), thinking the
    reasoning_content; redacted thinking is dropped; the sampling keys pass as they are."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": "m", "max_tokens": 8, "temperature": 0.3, "top_p": 0.9, "top_k": 5, "stop_sequences": ["X"],
            "metadata": {"user_id": "u"}, "service_tier": "auto", "tools": TOOLS,
            "tool_choice": {"type": "none"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                     "content": [{"type": "text", "text": "bad"}, url_image]}]}]}
    req = to_chat_body(body, PromptLimits())
    assert req.chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": [
            {"type": "text", "text": "bad"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    assert {k: req.chat[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "tool_choice")} == \
        {"max_tokens": 8, "temperature": 0.3, "top_p": 0.9, "top_k": 5, "stop": ["X"], "tool_choice": "none"}
    assert req.chat["tools"] == CHAT_TOOLS
    assert req.chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert (req.thinking, req.stream, req.stop_sequences) == (True, False, ("X",))
    off = to_chat_body({**body, "thinking": {"type": "disabled"}}, PromptLimits())
    assert (off.thinking, off.chat["chat_template_kwargs"]) == (False, {"enable_thinking": False})
    # A server that does not let requests set enable_thinking: thinking changes no render.
    assert "chat_template_kwargs" not in to_chat_body(body, PromptLimits(template_variables=())).chat


def test_what_claude_code_sends_is_accepted():
    """Claude Code's requests (its bundled CLI, recorded offline against a session): a system
    message inside ``messages``, ``context_management``, tools with ``defer_loading``, and
    ``thinking.display: "updates"``. The system message stays at its place; the rest changes
    nothing the gateway renders."""
    body = {"model": "m", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u"},
            "output_config": {"effort": "high"}, "thinking": {"type": "adaptive", "display": "updates"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": [{**TOOLS[0], "defer_loading": True, "strict": True}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "# Environment\ncwd: /tmp"},
                         {"role": "user", "content": [{"type": "text", "text": "go"}]}]}
    req = to_chat_body(body, PromptLimits())
    assert [m["role"] for m in req.chat["messages"]] == ["system", "user", "system", "user"]
    assert req.chat["messages"][2]["content"] == "# Environment\ncwd: /tmp"
    assert req.chat["tools"] == [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}]
    assert req.thinking is True


@pytest.mark.parametrize(("change", "named"), [
    ({"max_tokens": None}, "'max_tokens'"),
    ({"model": None}, "'model'"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"messages": []}, "'messages'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "'tool_use' block"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "'role'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "'any'"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "calculator"}}, "'tool'"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"container": "container_1"}, "'container'"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "'mcp_servers'"),
    ({"thinking": {"type": "sometimes"}}, "'thinking'"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"stop_sequences": "STOP"}, "'stop_sequences'"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "source"),
])
async def test_bad_input_is_a_value_error_naming_the_key(gateway, engine, change, named):
    """Unsupported or malformed input is refused (the HTTP layer answers 400) before anything
    reaches the engine, streamed or not, and the message names what to fix."""
    body = {k: v for k, v in {**ask(), **change}.items() if v is not None}
    for streamed in (False, True):
        with pytest.raises(ValueError, match=named):
            await create_message(gateway, {**body, "stream": streamed})
    assert engine.calls == []


async def test_an_image_reaches_the_chat_path(gateway, engine):
    """A base64 image block becomes an image part, which this text-only gateway refuses as chat does."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(ValueError, match="reads text only"):
        await create_message(gateway, {**ask(), "messages": [{"role": "user", "content": [image]}]})
    assert engine.calls == []


async def test_a_stop_sequence_is_named_and_the_ids_end_at_it(gateway, engine, replies, tokenizer):
    """``stop_sequences`` cut the text before the string and the ids after the token completing
    it; the message says which string matched, streamed or not."""
    replies.by_prompt["count"] = ["one two three STOP four five"] * 2
    body = ask("count", stop_sequences=["never", "STOP"])
    m = await message(gateway, body)
    assert m["content"] == [{"type": "text", "text": "one two three"}]  # the reasoning parser trims
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "STOP")
    sampled = engine.calls[0].output.token_ids
    assert m["token_ids"] == sampled[: len(m["token_ids"])]
    assert tokenizer.decode(m["token_ids"]).endswith("STOP")
    events = await collect(await stream(gateway, body))
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert delta["token_ids"] == m["token_ids"]


async def test_max_tokens_stops_with_max_tokens(gateway, engine, replies):
    replies.by_prompt["long"] = ["a b c d e f g h i j k l m n o p"]
    m = await message(gateway, ask("long", max_tokens=3))
    assert (m["stop_reason"], m["stop_sequence"]) == ("max_tokens", None)
    assert m["usage"]["output_tokens"] == 3 == len(engine.calls[0].output.token_ids)


async def test_thinking_blocks_come_back_only_when_thinking_is_enabled(gateway, engine, replies):
    """The reasoning parser's reasoning is a thinking block before the text when the request
    enables thinking; without, the client gets the text alone (the ids hold both either way)."""
    replies.by_prompt[QUESTION] = [THOUGHT + "It is 7."] * 3
    on = await message(gateway, ask(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert on["content"] == [{"type": "thinking", "thinking": "Three and four make seven.", "signature": ""},
                             {"type": "text", "text": "It is 7."}]
    off = await message(gateway, ask())
    assert off["content"] == [{"type": "text", "text": "It is 7."}]
    assert off["token_ids"] == on["token_ids"] == engine.calls[0].output.token_ids
    hidden = await message(gateway, ask(thinking={"type": "adaptive", "display": "omitted"}))
    assert hidden["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}


# ---- streamed --------------------------------------------------------------------------


async def test_streamed_events_build_the_non_streamed_message(tokenizer):
    """Thinking, text and a tool call stream token by token as three blocks, in Anthropic's
    event order, and assemble into exactly the non-streamed message's content."""
    reply = THOUGHT + "Let me compute. " + hermes_call("calculator", expression="3 + 4")
    script = StreamingScript(tokenizer, reply)
    gateway = Gateway(script, tokenizer, tool_parser="hermes", reasoning_parser="qwen3")
    body = ask(tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024})
    whole = await message(gateway, body)
    events = await collect(await stream(gateway, body))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert (start["content"], start["stop_reason"], start["model"]) == ([], None, "claude-test")
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == \
        ["thinking", "text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert sum(e.get("delta", {}).get("type") == "text_delta" for e in events) > 1  # sent as generated
    blocks = assemble(events)
    assert blocks == whole["content"]
    assert blocks[2]["input"] == {"expression": "3 + 4"}
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["token_ids"] == whole["token_ids"] == script.ids
    assert delta["prompt_token_ids"] == whole["prompt_token_ids"]
    assert delta["usage"]["output_tokens"] == len(script.ids)
    assert delta["usage"]["input_tokens"] == len(whole["prompt_token_ids"])


async def test_a_stream_closed_early_closes_the_chat_stream(tokenizer):
    """A client that goes away: closing the event iterator closes the engine stream and
    records nothing."""
    script = StreamingScript(tokenizer, "one two three four five six seven eight")
    gateway = Gateway(script, tokenizer)
    gateway.open_session("gone")
    events = await stream(gateway, ask(), session_id="gone")
    assert (await anext(events))["type"] == "message_start"
    await events.aclose()
    assert gateway.recorder.get("gone") == []


# ---- sessions and counting --------------------------------------------------------------


async def test_a_tool_loop_in_a_session_continues_the_exact_ids(gateway, engine, replies):
    """tool_use, then the tool_result sent back with the returned content: the second prompt
    extends the first prompt + generated ids, and both calls are recorded as messages."""
    replies.by_prompt[QUESTION] = ["Let me compute. " + hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt["<tool_response>\n7\n</tool_response>"] = ["The answer is 7."]
    body = ask(tools=TOOLS)
    first = await message(gateway, body, session_id="traj-m")
    assert first["stop_reason"] == "tool_use"
    assert first["session_id"] == "traj-m"
    use = first["content"][-1]
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "calculator", {"expression": "3 + 4"})
    body["messages"] += [{"role": "assistant", "content": first["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "7"}]}]
    counted = await count_tokens(gateway, {k: v for k, v in body.items() if k != "max_tokens"}, session_id="traj-m")
    final = await message(gateway, body, session_id="traj-m")
    assert final["content"] == [{"type": "text", "text": "The answer is 7."}]
    assert final["stop_reason"] == "end_turn"
    assert counted["input_tokens"] == final["usage"]["input_tokens"]
    assert gateway.continued_calls == 1
    calls = gateway.close_session("traj-m")
    assert [c.endpoint for c in calls] == ["messages", "messages"]
    assert [c.finish_reason for c in calls] == ["tool_calls", "stop"]
    for rec, sent in zip(calls, engine.calls, strict=True):
        assert (rec.prompt_ids, rec.token_ids) == (sent.prompt_ids, sent.output.token_ids)
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].token_ids)] == \
        calls[0].prompt_ids + calls[0].token_ids


async def test_count_tokens_takes_no_generation_keys(gateway, engine):
    with pytest.raises(ValueError, match="max_tokens"):
        await count_tokens(gateway, ask())
    with pytest.raises(ValueError, match="'model'"):
        await count_tokens(gateway, {"messages": [{"role": "user", "content": "hi"}]})
    assert engine.calls == []


def test_error_types_follow_anthropics_table():
    assert [anthropic_error_type(s) for s in (400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "invalid_request_error", "request_too_large", "invalid_request_error", "rate_limit_error", "api_error",
        "api_error", "overloaded_error", "timeout_error", "overloaded_error"]


# ---- the stock anthropic client over HTTP -----------------------------------------------


@pytest.fixture
def sdk():
    anthropic = pytest.importorskip("anthropic", reason='SDK tests need the anthropic client: pip install anthropic')
    pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    return anthropic


@pytest.fixture
def thread(gateway, sdk):
    from agentloop_engines.serving.gateway import GatewayThread

    with GatewayThread(gateway, api_key=KEY) as t:
        yield t


def client(sdk, url: str):
    # The SDK appends /v1/messages to its base URL, so a session's base URL goes without /v1.
    return sdk.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=30)


def test_sdk_create_stream_and_count_tokens(thread, sdk, engine, replies):
    """``messages.create``, ``messages.stream`` (``text_stream``, ``get_final_message``) and
    ``messages.count_tokens`` parse the gateway's answers, with the exact ids alongside."""
    replies.by_prompt["hi"] = ["Hello there."] * 2
    c = client(sdk, thread.url)
    messages = [{"role": "user", "content": "hi"}]
    counted = c.messages.count_tokens(model="claude-test", messages=messages).input_tokens
    m = c.messages.create(model="claude-test", max_tokens=32, messages=messages)
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there.")]
    assert (m.stop_reason, m.stop_sequence, m.model) == ("end_turn", None, "claude-test")
    assert m.usage.input_tokens == counted == len(engine.calls[0].prompt_ids)
    assert m.usage.output_tokens == len(engine.calls[0].output.token_ids)
    assert m.model_extra["token_ids"] == engine.calls[0].output.token_ids
    assert m.model_extra["prompt_token_ids"] == engine.calls[0].prompt_ids
    with c.messages.stream(model="claude-test", max_tokens=32, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there."
    assert [(b.type, b.text) for b in final.content] == [("text", "Hello there.")]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        ("end_turn", counted, m.usage.output_tokens)
    assert len(engine.calls) == 2


def test_sdk_tool_loop_with_thinking_in_a_session_continues_the_exact_ids(thread, sdk, gateway, engine, replies):
    """thinking + tool_use, the content sent back as the SDK returned it with a tool_result,
    then a streamed final answer: each prompt extends the previous prompt + generated ids."""
    replies.by_prompt[QUESTION] = [THOUGHT + "Let me compute. " + hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt["<tool_response>\n7\n</tool_response>"] = ["The answer is 7."]
    c = client(sdk, thread.session_url("traj-sdk"))
    messages: list = [{"role": "user", "content": QUESTION}]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    first = c.messages.create(model="m", max_tokens=128, messages=messages, tools=TOOLS, thinking=thinking)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "Three and four make seven."
    use = first.content[2]
    assert (first.stop_reason, use.name, use.input) == ("tool_use", "calculator", {"expression": "3 + 4"})
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]}]
    with c.messages.stream(model="m", max_tokens=128, messages=messages, tools=TOOLS, thinking=thinking) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "The answer is 7.")]
    assert final.stop_reason == "end_turn"
    calls = gateway.close_session("traj-sdk")
    assert [c.endpoint for c in calls] == ["messages", "messages"]
    for rec, sent in zip(calls, engine.calls, strict=True):
        assert (rec.prompt_ids, rec.token_ids, rec.log_probs) == \
            (sent.prompt_ids, sent.output.token_ids, sent.output.log_probs)
        assert sent.request_id == "traj-sdk"
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].token_ids)] == \
        calls[0].prompt_ids + calls[0].token_ids
    assert calls[1].extra["extends_previous"] is True


def test_sdk_stop_sequences_and_max_tokens(thread, sdk, replies):
    replies.by_prompt["count"] = ["one two three STOP four five"] * 2
    c = client(sdk, thread.url)
    messages = [{"role": "user", "content": "count"}]
    m = c.messages.create(model="m", max_tokens=64, messages=messages, stop_sequences=["STOP"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "STOP", "one two three")
    short = c.messages.create(model="m", max_tokens=2, messages=messages)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 2)


def test_sdk_bad_input_is_a_400_naming_the_key(thread, sdk, engine):
    c = client(sdk, thread.url)
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    for kwargs, named in [({"messages": [{"role": "user", "content": [document]}]}, "'document'"),
                          ({"messages": [{"role": "user", "content": "hi"}], "extra_body": {"max_tokens": None}},
                           "'max_tokens'"),
                          ({"messages": [{"role": "user", "content": "hi"}], "tools": [
                              {"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305")]:
        with pytest.raises(sdk.BadRequestError) as info:
            c.messages.create(model="m", max_tokens=16, **kwargs)
        assert info.value.body["type"] == "error", info.value.body
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert named in info.value.body["error"]["message"]
    with pytest.raises(sdk.BadRequestError, match="document"):
        c.messages.count_tokens(model="m", messages=[{"role": "user", "content": [document]}])
    assert engine.calls == []
