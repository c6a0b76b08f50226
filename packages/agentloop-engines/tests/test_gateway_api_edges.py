"""Edges of the Responses and Messages APIs, driven by the stock ``openai`` and ``anthropic`` clients.

Each test is one way a reply can end (text after a call, a cut after a complete call, nothing
but the end of the turn, an engine failing mid-stream) or a body the gateway cannot serve (a lone
surrogate, echoed fields it could not send back), checked through the real gateway over HTTP:
what the client gets, and that the session still records one training sequence where the
agent changed nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
anthropic = pytest.importorskip("anthropic", reason='gateway tests need: pip install "agentloop-engines[test]"')
httpx = pytest.importorskip("httpx", reason='gateway tests need: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams  # noqa: E402
from agentloop_engines.fleet.routing import RequestTimeoutError  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.streaming import TokenDelta  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import StreamingScript, calculator_call  # noqa: E402

QUESTION = "What is 3 + 4?"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
ANTHROPIC_TOOLS = [{"name": "calculator", "description": "Evaluate.", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate.", "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": SCHEMA}}]


def _anthropic(url: str) -> Any:
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=30)


def _openai(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def _extends(gateway: Gateway, session: str) -> list[bool]:
    return [call.extra["extends_previous"] for call in gateway.recorder.get(session)]


def test_streamed_messages_reply_with_text_after_its_call_continues_the_session(tokenizer, replies, engine):
    """Streamed, text after a call comes as a third block; sent back, the three blocks are the
    reply the gateway returned, so the next call continues its ids (as a whole reply's does)."""
    replies.by_prompt[QUESTION] = ["Let me compute. " + calculator_call("3 + 4") + "\nI will wait for the result."] * 2
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with GatewayThread(gateway) as thread:
        for stream in (False, True):
            session = f"text-after-call-{stream}"
            client = _anthropic(thread.session_url(session))
            messages: list = [{"role": "user", "content": QUESTION}]
            if stream:
                with client.messages.stream(model="m", max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS) as s:
                    reply = s.get_final_message()
                assert [b.type for b in reply.content] == ["text", "tool_use", "text"]
            else:
                reply = client.messages.create(model="m", max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS)
            (use,) = [b for b in reply.content if b.type == "tool_use"]
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]}]
            client.messages.create(model="m", max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS)
            first, second = gateway.recorder.get(session)
            assert second.extra["extends_previous"] is True, f"stream={stream}: the resent reply started a new segment"
            assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == first.prompt_ids + first.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reply_cut_after_a_complete_call_is_reported_as_cut(tokenizer, replies, engine, stream):
    """max_tokens cuts the second of two calls: every API reports the cut (max_tokens, incomplete,
    length), not a finished tool-use turn, and records finish_reason length."""
    first_call = calculator_call("3 + 4")
    replies.by_prompt[QUESTION] = [first_call + "\n" + calculator_call("4 + 3")] * 3
    cut = len(tokenizer.encode(first_call + '\n<tool_call>\n{"name": "calc', add_special_tokens=False))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    user = [{"role": "user", "content": QUESTION}]
    with GatewayThread(gateway) as thread:
        messages = _anthropic(thread.session_url("cut"))
        if stream:
            with messages.messages.stream(model="m", max_tokens=cut, messages=user, tools=ANTHROPIC_TOOLS) as s:
                message = s.get_final_message()
        else:
            message = messages.messages.create(model="m", max_tokens=cut, messages=user, tools=ANTHROPIC_TOOLS)
        assert [b.type for b in message.content] == ["tool_use"]
        assert message.stop_reason == "max_tokens"
        client = _openai(thread.session_url("cut"))
        if stream:
            # The SDK's get_final_response() wants response.completed; the last event carries the response.
            response = list(client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS,
                                                    max_output_tokens=cut, stream=True))[-1].response
            chunks = list(client.chat.completions.create(model="m", messages=user, tools=CHAT_TOOLS, max_tokens=cut,
                                                         stream=True))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            response = client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=cut)
            chat = client.chat.completions.create(model="m", messages=user, tools=CHAT_TOOLS, max_tokens=cut)
            finish = [chat.choices[0].finish_reason]
        assert [o.type for o in response.output] == ["function_call"]
        assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert finish == ["length"]
    assert [(c.stop_reason, c.finish_reason) for c in gateway.recorder.get("cut")] == [("length", "length")] * 3


def test_lone_surrogate_is_a_400_naming_where_before_anything_is_generated(tokenizer, engine):
    """A lone surrogate is valid JSON but not text: every route answers 400 naming its place,
    the engine is never called, nothing is recorded, and the connection serves the next request."""
    gateway = Gateway(engine, tokenizer)
    bodies = {
        "chat/completions": ('{"model":"m","messages":[{"role":"user","content":"hi \\ud800"}]}',
                             "messages[0].content"),
        "responses": ('{"model":"m","input":"hi \\ud800"}', "input"),
        "messages": ('{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi \\ud800"}]}',
                     "messages[0].content"),
        "messages/count_tokens": ('{"model":"m","messages":[{"role":"user","content":"hi \\ud800"}]}',
                                  "messages[0].content"),
        "completions": ('{"model":"m","prompt":"hi \\ud800","max_tokens":3}', "prompt"),
    }
    with GatewayThread(gateway) as thread, httpx.Client(timeout=30) as client:
        url = thread.session_url("surrogate")
        for stream in ("false", "true"):
            echoed = '{"model":"m","input":"hi","stream":' + stream + ',"metadata":{"note":"x\\ud800"}}'
            bodies[f"responses stream={stream}"] = (echoed, "metadata.note")
        for route, (body, where) in bodies.items():
            answer = client.post(f"{url}/{route.split()[0]}", content=body.encode(),
                                 headers={"content-type": "application/json"})
            assert answer.status_code == 400, (route, answer.text)
            message = answer.json()["error"]["message"]
            assert f"{where} holds a lone UTF-16 surrogate" in message, route
            assert "send valid text" in message, route
            # The same keep-alive connection answers the next request.
            assert client.get(f"{thread.url}/health").status_code == 200
    assert engine.calls == []
    assert gateway.recorder.get("surrogate") == []


class _FailingStream(StreamingScript):
    """Streams three tokens of its reply, then fails as a replica that timed out mid-decode."""

    async def _generate_stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                               images: tuple = ()) -> AsyncGenerator[TokenDelta, None]:
        for tok in self.ids[:3]:
            await asyncio.sleep(0)
            yield TokenDelta([tok], [-0.5] if sp.logprobs else None)
        raise RequestTimeoutError("engine replica timed out mid-decode")


def test_engine_failure_mid_stream_reaches_each_client_as_an_api_error(tokenizer):
    """An engine that fails after the stream started: each API's stream ends with its own error
    event, so the stock clients raise an API error carrying the message, not a connection error."""
    gateway = Gateway(_FailingStream(tokenizer, "Hello there, my good friend, how are you?"), tokenizer)
    user = [{"role": "user", "content": "hi"}]
    with GatewayThread(gateway) as thread:
        stream = _anthropic(thread.session_url("fail")).messages.stream(model="m", max_tokens=100, messages=user)
        with pytest.raises(anthropic.APIStatusError) as failed, stream as s:
            s.get_final_message()
        assert failed.value.body["error"]["type"] == "timeout_error"
        assert "engine replica timed out mid-decode" in failed.value.body["error"]["message"]
        client = _openai(thread.session_url("fail"))
        for name, call in (("responses", lambda: client.responses.stream(model="m", input="hi").__enter__()
                            .get_final_response()),
                           ("chat", lambda: list(client.chat.completions.create(model="m", messages=user,
                                                                                stream=True)))):
            with pytest.raises(openai.APIError) as error:
                call()
            assert not isinstance(error.value, openai.APIConnectionError), name
            assert "engine replica timed out mid-decode" in error.value.message, name
        # Raw Responses events: the failed response, then the error event.
        with httpx.stream("POST", f"{thread.session_url('fail')}/responses", json={"input": "hi", "stream": True},
                          timeout=30) as raw:
            kinds = [line.removeprefix("event: ") for line in raw.iter_lines() if line.startswith("event: ")]
        assert kinds[-2:] == ["response.failed", "error"]
    assert gateway.recorder.get("fail") == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reply_of_only_the_end_of_turn_is_an_empty_message_that_continues(tokenizer, replies, engine, stream):
    """A reply of nothing but the end-of-turn token is one message item with an empty
    output_text; the items sent back continue the session's ids."""
    replies.by_prompt["hi"] = [""]
    replies.by_prompt["Say something."] = ["Something."]
    gateway = Gateway(engine, tokenizer)
    with GatewayThread(gateway) as thread:
        client = _openai(thread.session_url("empty"))
        if stream:
            with client.responses.stream(model="m", input="hi") as s:
                response = s.get_final_response()
        else:
            response = client.responses.create(model="m", input="hi")
        assert [(o.type, [c.text for c in o.content]) for o in response.output] == [("message", [""])]
        items = [{"role": "user", "content": "hi"}, *[o.model_dump(exclude_none=True) for o in response.output],
                 {"role": "user", "content": "Say something."}]
        assert client.responses.create(model="m", input=items).output_text == "Something."
    assert _extends(gateway, "empty") == [False, True]


def test_usage_counts_the_prompt_at_message_start_and_the_reasoning_tokens(tokenizer):
    """message_start reports the prompt's length (not 0); Responses counts the reasoning ids."""
    reply = "<think>\nLet me think about greeting.\n</think>\n\nHello."
    ids = tokenizer.encode(reply, add_special_tokens=False)
    thought = next(n for n in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:n]))
    gateway = Gateway(StreamingScript(tokenizer, reply), tokenizer, reasoning_parser="qwen3")
    with GatewayThread(gateway) as thread:
        with _anthropic(thread.base_url).messages.stream(model="m", max_tokens=100,
                                                         messages=[{"role": "user", "content": "hi"}]) as s:
            start = next(e for e in s if e.type == "message_start")
            final = s.get_final_message()
        assert start.message.usage.input_tokens == final.usage.input_tokens > 0
        client = _openai(thread.base_url)
        whole = client.responses.create(model="m", input="hi")
        with client.responses.stream(model="m", input="hi") as s:
            streamed = s.get_final_response()
    for response in (whole, streamed):
        assert [o.type for o in response.output] == ["reasoning", "message"]
        assert response.usage.output_tokens_details.reasoning_tokens == thought


@pytest.mark.parametrize(("field", "value", "named"), [
    ("metadata", {"k": {"a": {"a": "x"}}}, "metadata['k']"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "at most 16 key/value pairs"),
    ("metadata", {"k" * 65: "v"}, "at most 64 characters"),
    ("metadata", {"k": "v" * 513}, "at most 512 characters"),
    ("reasoning", {"effort": [["deep"]]}, "reasoning['effort']"),
    ("user", {"id": 1}, "'user' must be a string"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_refuses_echoed_fields_it_could_not_send_back(tokenizer, engine, field, value, named, stream):
    """metadata, reasoning and user are echoed in the response: a shape OpenAI refuses is a 400
    naming it before anything is generated or recorded (it used to fail only when the answer
    was serialised, after the call was recorded)."""
    gateway = Gateway(engine, tokenizer)
    with GatewayThread(gateway) as thread, pytest.raises(openai.BadRequestError) as refused:
        _openai(thread.session_url("echo")).responses.create(model="m", input="hi", stream=stream, **{field: value})
    assert named in refused.value.message
    assert engine.calls == []
    assert gateway.recorder.get("echo") == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_lone_surrogate_the_policy_writes_in_its_call_is_a_call_error_every_api_answers(tokenizer, replies, engine,
                                                                                           stream):
    """The policy is the adversary: it escapes an unpaired surrogate into its call's JSON. The
    call is a parse error (``tool_call_errors``), the reply its text, and each client gets an
    answer (it was a failed serialization: a 400 after the call was recorded, or a broken stream)."""
    escaped = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 \\ud800 4"}}\n</tool_call>'
    replies.by_prompt[QUESTION] = [escaped] * 3
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    user = [{"role": "user", "content": QUESTION}]
    with GatewayThread(gateway) as thread:
        messages = _anthropic(thread.session_url("adversary"))
        if stream:
            with messages.messages.stream(model="m", max_tokens=200, messages=user, tools=ANTHROPIC_TOOLS) as s:
                message = s.get_final_message()
        else:
            message = messages.messages.create(model="m", max_tokens=200, messages=user, tools=ANTHROPIC_TOOLS)
        assert [b.type for b in message.content] == ["text"]
        assert "\\ud800" in message.content[0].text  # the model's own six characters, as it wrote them
        client = _openai(thread.session_url("adversary"))
        if stream:
            response = list(client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS,
                                                    stream=True))[-1].response
            chunks = list(client.chat.completions.create(model="m", messages=user, tools=CHAT_TOOLS, stream=True))
            calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        else:
            response = client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
            chat = client.chat.completions.create(model="m", messages=user, tools=CHAT_TOOLS)
            calls = chat.choices[0].message.tool_calls or []
            assert "lone UTF-16 surrogate" in str(chat.model_extra) + str(chat.choices[0].model_extra)
        assert [o.type for o in response.output] == ["message"]
        assert calls == []
    assert len(gateway.recorder.get("adversary")) == 3
