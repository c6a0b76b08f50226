"""The Responses API (``/v1/responses``) served as a translation of the gateway's chat path.

The engine is a ScriptedServer replying with encoded text keyed by prompt, so each test decides
what the "model" says; rendering (the tiny tokenizer's ChatML template), tool-call parsing
(hermes), reasoning parsing (qwen3) are real. The first tests call ``create_response`` on a
Gateway; the last ones drive ``/v1/responses`` with the stock ``openai`` client over HTTP. Every
response and event is validated against the SDK's own pydantic models, so a shape the SDK would
not parse fails here. A failure in an exact-id assertion means the translation changed what was
rendered (compare the recorded call's ``request["messages"]`` with the chat conversation), or a
stream and a whole answer disagree (compare the events with ``gateway.recorder.get(...)``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pydantic = pytest.importorskip("pydantic", reason="the openai client depends on pydantic")

from openai import BadRequestError, OpenAI  # noqa: E402
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent  # noqa: E402

from agentloop_engines.serving.gateway import Gateway, PromptLimits  # noqa: E402
from agentloop_engines.serving.gateway.responses_api import create_response  # noqa: E402
from agentloop_engines.serving.gateway.responses_request import input_messages  # noqa: E402
from agentloop_engines.serving.gateway.responses_stream import ResponseEvents  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import hermes_call  # noqa: E402

KEY = "gw-key"
TOOLS: list[Any] = [{"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
QUESTION = "What is 3 + 4?"
RESULT = "<tool_response>\n7\n</tool_response>"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def gateway(engine, tokenizer):
    return Gateway(engine, tokenizer, tool_parser="hermes", model_name="tiny")


def rendered(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def checked(response: dict[str, Any]) -> Response:
    """The response as the SDK's strict model reads it (a missing or mistyped field fails)."""
    return Response.model_validate(response)


async def respond(gateway, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``create_response`` of a body without ``stream``: the response object."""
    response = await create_response(gateway, body, **kwargs)
    assert isinstance(response, dict)
    return response


async def streamed(gateway, body: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    """The events of ``body`` streamed, each checked by the SDK's event models."""
    iterator = await create_response(gateway, {**body, "stream": True}, **kwargs)
    assert not isinstance(iterator, dict)
    events = [event async for event in iterator]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def exact_ids(response, sent) -> None:
    """The response carries the engine's ids: prompt, generated, log-probs."""
    assert response["prompt_token_ids"] == sent.prompt_ids
    assert response["token_ids"] == sent.output.token_ids
    assert response["token_logprobs"] == sent.output.log_probs
    assert response["usage"]["input_tokens"] == len(sent.prompt_ids)
    assert response["usage"]["output_tokens"] == len(sent.output.token_ids)


# ---- in process ----------------------------------------------------------------------------


async def test_text_input_and_instructions_render_as_chat_messages(gateway, engine, tokenizer, replies):
    """``input`` text is one user message and ``instructions`` a system message before it; the
    answer is one message item with the engine's exact ids. Debug: compare engine.calls[0]'s
    decoded prompt with the chat rendering."""
    replies.by_prompt["hi"] = ["Hello there."]
    r = await respond(gateway, {"model": "gpt-x", "input": "hi", "instructions": "Be terse."})
    assert engine.calls[0].prompt_ids == rendered(tokenizer, [{"role": "system", "content": "Be terse."},
                                                               {"role": "user", "content": "hi"}])
    model = checked(r)
    assert model.output_text == "Hello there."
    assert (model.status, model.incomplete_details, model.model, model.instructions) == \
        ("completed", None, "gpt-x", "Be terse.")
    assert [item.type for item in model.output] == ["message"]
    assert r["id"].startswith("resp_")
    assert r["output"][0]["id"].startswith("msg_")
    assert "session_id" not in r
    exact_ids(r, engine.calls[0])


async def test_items_and_chat_messages_render_the_same_prompt(gateway, engine, tokenizer):
    """A conversation sent as Responses items renders to the same ids as the same conversation
    sent as chat messages (one renderer serves both). Debug: diff the two recorded requests'
    messages."""
    chat_messages = [
        {"role": "developer", "content": "Use the tool."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "3 + 4?"}]},
        {"role": "assistant", "content": "Computing.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "calculator",
                                                              "arguments": '{"expression": "3 + 4"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "7"},
        {"role": "tool", "tool_call_id": "call_b", "content": "7"},
        {"role": "user", "content": "Thanks."}]
    items = [
        {"role": "developer", "content": "Use the tool."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is"},
                                                        {"type": "input_text", "text": "3 + 4?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Computing.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "calculator", "arguments": '{"expression": "3 + 4"}'},
        {"type": "function_call", "call_id": "call_b", "name": "calculator", "arguments": '{"expression": "7"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "7"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "7"}]},
        {"role": "user", "content": "Thanks."}]
    await gateway.chat_completion({"messages": chat_messages, "tools": CHAT_TOOLS})
    await create_response(gateway, {"input": items, "tools": TOOLS})
    assert engine.calls[1].prompt_ids == engine.calls[0].prompt_ids
    assert engine.calls[0].prompt_ids == rendered(tokenizer, [{**m, "role": "system"} if m["role"] == "developer"
                                                              else m for m in chat_messages[:1]] + [
        {"role": "user", "content": "What is\n3 + 4?"}, *chat_messages[2:]], tools=CHAT_TOOLS)


async def test_tool_loop_in_a_session_continues_the_exact_ids(gateway, engine, replies):
    """function_call -> function_call_output -> final answer, the output items sent back as
    input: each call is recorded with the engine's ids, and the second prompt extends the first
    prompt + generated ids (the session's token-exact continuation). Debug: a False
    extends_previous means the items did not translate back to the assistant message returned."""
    replies.by_prompt[QUESTION] = [hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt[RESULT] = ["The answer is 7."]
    first = await respond(gateway, {"input": QUESTION, "tools": TOOLS, "instructions": "Be exact."}, session_id="loop")
    call = checked(first).output[0]
    assert isinstance(call, ResponseFunctionToolCall)
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "3 + 4"})
    assert (call.status, call.call_id) == ("completed", first["output"][0]["call_id"])
    assert call.call_id
    assert first["output"][0]["id"].startswith("fc_")
    assert first["session_id"] == "loop"
    conversation = [{"role": "user", "content": QUESTION}, *first["output"],
                    {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    final = await respond(gateway, {"input": conversation, "tools": TOOLS, "instructions": "Be exact."},
                                  session_id="loop")
    assert checked(final).output_text == "The answer is 7."

    calls = gateway.close_session("loop")
    assert [c.endpoint for c in calls] == ["responses", "responses"]
    assert [c.finish_reason for c in calls] == ["tool_calls", "stop"]
    for rec, sent, response in zip(calls, engine.calls, (first, final), strict=True):
        assert (rec.prompt_ids, rec.token_ids) == (sent.prompt_ids, sent.output.token_ids)
        assert sent.request_id == "loop"
        exact_ids(response, sent)
    assert calls[1].extra["extends_previous"] is True
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].token_ids)] == \
        calls[0].prompt_ids + calls[0].token_ids
    assert calls[1].request["messages"][2]["tool_calls"][0]["id"] == call.call_id


async def test_previous_response_id_continues_the_stored_conversation(gateway, engine, replies):
    """``previous_response_id`` in a session: the conversation is the stored one + the new
    input, so the prompt is the one resending the items gives, continued exactly; instructions
    are not carried over. Outside the session, unknown, or made with store=false: a 400 that says
    to send the whole input."""
    replies.by_prompt[QUESTION] = [hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt[RESULT] = ["The answer is 7."]
    first = await respond(gateway, {"input": QUESTION, "tools": TOOLS, "instructions": "Be exact."},
                                  session_id="prev")
    call_id = first["output"][0]["call_id"]
    final = await respond(gateway, {
        "input": [{"type": "function_call_output", "call_id": call_id, "output": "7"}], "tools": TOOLS,
        "instructions": "Be exact.", "previous_response_id": first["id"]}, session_id="prev")
    assert checked(final).output_text == "The answer is 7."
    assert final["previous_response_id"] == first["id"]
    assert gateway.recorder.get("prev")[1].extra["extends_previous"] is True
    assert engine.calls[1].prompt_ids[: len(engine.calls[0].prompt_ids)] == engine.calls[0].prompt_ids

    replies.by_prompt["And 5 + 5?"] = ["10."]
    third = await respond(gateway, {"input": "And 5 + 5?", "tools": TOOLS, "store": False,
                                            "previous_response_id": final["id"]}, session_id="prev")
    messages = gateway.recorder.get("prev")[2].request["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]  # no instructions
    assert checked(third).output_text == "10."
    with pytest.raises(ValueError, match="store=false"):
        await create_response(gateway, {"input": "x", "previous_response_id": third["id"]}, session_id="prev")
    with pytest.raises(ValueError, match="within a session only.*whole conversation as 'input'"):
        await create_response(gateway, {"input": "x", "previous_response_id": first["id"]})
    with pytest.raises(ValueError, match="not a response of session 'other'"):
        await create_response(gateway, {"input": "x", "previous_response_id": first["id"]}, session_id="other")
    gateway.close_session("prev")
    with pytest.raises(ValueError, match="not a response of session 'prev'"):
        await create_response(gateway, {"input": "x", "previous_response_id": first["id"]}, session_id="prev")


async def test_a_session_opened_anew_has_no_stored_responses(gateway):
    """Stored responses belong to one session: after the recorder dropped it (idle, evicted) an
    agent reusing the id gets a 400, not another trajectory's conversation; a response chains
    through every earlier one it continues."""
    first = await respond(gateway, {"input": "a"}, session_id="s")
    second = await respond(gateway, {"input": "b", "previous_response_id": first["id"]}, session_id="s")
    await create_response(gateway, {"input": "c", "previous_response_id": second["id"]}, session_id="s")
    assert [m["content"] for m in gateway.recorder.get("s")[-1].request["messages"] if m["role"] == "user"] == \
        ["a", "b", "c"]
    gateway.recorder.pop("s")  # dropped by the recorder, not closed through the gateway
    gateway.open_session("s")
    with pytest.raises(ValueError, match="not a response of session 's'"):
        await create_response(gateway, {"input": "d", "previous_response_id": second["id"]}, session_id="s")


async def test_max_output_tokens_makes_the_response_incomplete(gateway, engine, replies):
    """``max_output_tokens`` is the engine's ``max_tokens``; a generation cut by it is an
    ``incomplete`` response (reason ``max_output_tokens``), streamed or not."""
    replies.by_prompt["count"] = ["one two three four five six seven"] * 2
    r = await respond(gateway, {"input": "count", "max_output_tokens": 3})
    assert engine.calls[0].sampling_params.max_tokens == 3
    assert len(r["token_ids"]) == 3
    model = checked(r)
    assert (model.status, model.max_output_tokens) == ("incomplete", 3)
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"
    events = await streamed(gateway, {"input": "count", "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete"]


async def test_streamed_events_add_up_to_the_whole_response(gateway, engine, replies):
    """A streamed tool call and its text: the SDK's event models parse every event, sequence
    numbers count from 0, each item is done before the next is added, and the last event
    carries the response with the same output and the engine's exact ids."""
    text = "Let me compute. " + hermes_call("calculator", expression="3 + 4")
    replies.by_prompt[QUESTION] = [text, text]
    whole = await respond(gateway, {"input": QUESTION, "tools": TOOLS})
    events = await streamed(gateway, {"input": QUESTION, "tools": TOOLS}, session_id="st")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    opened: list[int] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            assert not opened, "an item was added before the previous one was done"
            opened.append(e["output_index"])
        elif e["type"] == "response.output_item.done":
            assert opened.pop() == e["output_index"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me compute."
    done = events[-1]["response"]
    strip = ("id", "created_at", "completed_at", "session_id")
    assert [{k: v for k, v in item.items() if k != "id"} for item in done["output"]] == \
        [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]
    assert {k: v for k, v in done.items() if k not in (*strip, "output")} == \
        {k: v for k, v in whole.items() if k not in (*strip, "output")}
    assert done["session_id"] == "st"
    exact_ids(done, engine.calls[1])
    added = {e["item"]["id"] for e in events if e["type"] == "response.output_item.added"}
    assert added == {item["id"] for item in done["output"]}


async def test_a_reasoning_model_returns_a_reasoning_item(engine, tokenizer, replies):
    """With a reasoning parser the reasoning is a ``reasoning`` item (``reasoning_text``
    content) before the message, streamed as ``response.reasoning_text.delta``; sent back as
    input it becomes the assistant message's ``reasoning_content`` again."""
    gateway = Gateway(engine, tokenizer, tool_parser="hermes", reasoning_parser="qwen3")
    replies.by_prompt["Add 1 and 1."] = ["<think>\nOne plus one.\n</think>\n\nIt is 2."] * 2
    r = await respond(gateway, {"input": "Add 1 and 1.", "reasoning": {"effort": "high"}}, session_id="r")
    model = checked(r)
    assert [item.type for item in model.output] == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "One plus one."}]
    assert r["output"][0]["id"].startswith("rs_")
    assert model.output_text == "It is 2."
    events = await streamed(gateway, {"input": "Add 1 and 1."})
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "One plus one."
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == ["One plus one."]
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]
    await create_response(gateway, {"input": [{"role": "user", "content": "Add 1 and 1."}, *r["output"],
                                              {"role": "user", "content": "Thanks."}]}, session_id="r")
    assistant = gateway.recorder.get("r")[1].request["messages"][1]
    assert (assistant["reasoning_content"], assistant["content"]) == ("One plus one.", "It is 2.")
    assert gateway.recorder.get("r")[1].extra["extends_previous"] is True


def test_consecutive_output_items_join_one_assistant_message():
    """Reasoning, message and function_call items in a row are one assistant turn (a reasoning
    item after text or calls starts the next); function_call_output items are tool messages."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages = input_messages([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
        call, {**call, "call_id": "c2"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "B"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "not rendered"}]},
        {**call, "call_id": "c3"},
        {"type": "function_call_output", "call_id": "c3", "output": "out"}])
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "AB", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "out"}]
    image = input_messages([{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"}]}])
    assert image[0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}


def test_text_after_a_call_streams_as_a_second_message_item():
    """The stream never reopens a done item: text sent after a call is a new message item, and
    the assistant message the deltas add up to is the chat answer's."""
    events = ResponseEvents()
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    out = [*events.feed({"content": "A"}), *events.feed({"tool_calls": [call]}), *events.feed({"content": " B"}),
           *events.finish("tool_calls")]
    for event in out:
        EVENTS.validate_python(event)
    assert [item["type"] for item in events.output] == ["message", "function_call", "message"]
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert events.message() == {"role": "assistant", "content": "A B", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize(("body", "named"), [
    ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "calculator"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "text="),
    ({"input": "x", "conversation": "conv_1"}, "'conversation'"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "token_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "'input'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, r"input\[0\] is an item_reference"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, r"input\[0\] has type 'web_search_call'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, r"input\[0\]\.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, r"input\[0\].content\[0\]"),
    ({"input": [{"role": "tool", "content": "x"}]}, r"input\[0\].role"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
])
async def test_bad_input_is_refused_naming_the_key(gateway, engine, body, named):
    """Anything the gateway cannot honour is a ValueError (400) naming the key or item, raised
    before a stream's first event and before the engine is called."""
    for stream in (False, True):
        with pytest.raises(ValueError, match=named):
            await create_response(gateway, {**body, "stream": stream})
    assert engine.calls == []


async def test_an_oversized_input_list_is_refused_before_it_is_walked(engine, tokenizer):
    gateway = Gateway(engine, tokenizer, prompt_limits=PromptLimits(max_messages=2))
    with pytest.raises(ValueError, match="'input' has 3 entries; the limit is 2"):
        await create_response(gateway, {"input": [{"role": "user", "content": "x"}] * 3})


async def test_harmless_keys_are_accepted(gateway, engine, replies):
    """Keys that do not change what is generated are accepted (and echoed where the response
    repeats them); sampling keys reach the engine."""
    replies.by_prompt["hi"] = ["ok"]
    r = await respond(gateway, {
        "input": "hi", "store": True, "metadata": {"k": "v"}, "user": "u", "parallel_tool_calls": False,
        "truncation": "auto", "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}, "verbosity": "low"}, "top_logprobs": 0, "service_tier": "auto",
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "tool_choice": "none", "tools": TOOLS})
    model = checked(r)
    assert model.output_text == "ok"
    assert (model.metadata, model.parallel_tool_calls, model.temperature, model.top_p, model.tool_choice) == \
        ({"k": "v"}, False, 0.5, 0.9, "none")
    params = engine.calls[0].sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 5, 3)


# ---- over HTTP, with the stock openai client -------------------------------------------------


@pytest.fixture
def thread(gateway):
    pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    from agentloop_engines.serving.gateway import GatewayThread

    with GatewayThread(gateway, api_key=KEY) as t:
        yield t


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)


def test_http_tool_loop_with_items_then_previous_response_id(thread, gateway, engine, replies):
    """The SDK's own output objects sent back as input, then ``previous_response_id``: every
    call is recorded with the engine's ids and continues the previous one exactly. Debug: a
    call whose extends_previous is False rendered something else than the conversation the
    engine saw (compare its request messages with the one before)."""
    replies.by_prompt[QUESTION] = [hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt[RESULT] = ["The answer is 7."]
    replies.by_prompt["And doubled?"] = ["14."]
    c = client(thread.session_url("http-loop"))
    first = c.responses.create(model="m", input=QUESTION, tools=TOOLS, instructions="Be exact.")
    call = first.output[0]
    assert isinstance(call, ResponseFunctionToolCall)
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "3 + 4"})
    items: list[Any] = [{"role": "user", "content": QUESTION}, *first.output,
                        {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    final = c.responses.create(model="m", tools=TOOLS, instructions="Be exact.", input=items)
    assert final.output_text == "The answer is 7."
    assert final.status == "completed"
    more = c.responses.create(model="m", tools=TOOLS, instructions="Be exact.",
                              input="And doubled?", previous_response_id=final.id)
    assert more.output_text == "14."
    assert more.previous_response_id == final.id

    calls = gateway.close_session("http-loop")
    assert [rec.finish_reason for rec in calls] == ["tool_calls", "stop", "stop"]
    for rec, sent, response in zip(calls, engine.calls, (first, final, more), strict=True):
        assert (rec.prompt_ids, rec.token_ids, rec.log_probs) == \
            (sent.prompt_ids, sent.output.token_ids, sent.output.log_probs)
        exact_ids(response.to_dict(), sent)
    assert [rec.extra["extends_previous"] for rec in calls] == [False, True, True]
    for before, after in zip(calls, calls[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.token_ids)] == \
            before.prompt_ids + before.token_ids


def test_http_streams_parse_with_create_and_the_stream_helper(thread, engine, replies):
    """``responses.create(stream=True)`` yields the typed events and ``responses.stream()``
    assembles them into the final response, text and calls; the last event carries the
    engine's ids."""
    text = "Let me compute. " + hermes_call("calculator", expression="3 + 4")
    replies.by_prompt[QUESTION] = [text, text]
    c = client(thread.base_url)
    events = list(c.responses.create(model="m", input=QUESTION, tools=TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me compute."
    done = events[-1].response
    exact_ids(done.to_dict(), engine.calls[0])
    assert [item.type for item in done.output] == ["message", "function_call"]

    with c.responses.stream(model="m", input=QUESTION, tools=TOOLS) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Let me compute."
    call = final.output[1]
    assert isinstance(call, ResponseFunctionToolCall)
    assert json.loads(call.arguments) == {"expression": "3 + 4"}
    exact_ids(final.to_dict(), engine.calls[1])


def test_http_incomplete_and_refused_requests(thread, replies):
    """A cut generation is ``incomplete`` over HTTP, streamed or not; a request the gateway
    cannot honour is a 400 naming the key, before any event."""
    replies.by_prompt["count"] = ["one two three four five six"] * 2
    c = client(thread.base_url)
    r = c.responses.create(model="m", input="count", max_output_tokens=2)
    assert r.status == "incomplete"
    assert r.to_dict()["incomplete_details"] == {"reason": "max_output_tokens"}
    events = list(c.responses.create(model="m", input="count", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    for kwargs, named in [({"tools": [{"type": "web_search"}]}, "function tools only"),
                          ({"previous_response_id": "resp_1"}, "within a session only"),
                          ({"stream": True, "tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(BadRequestError) as info:
            c.responses.create(model="m", input="count", **kwargs)
        assert named in str(info.value.body)
