"""One conversation, three APIs: chat completions, Responses and Messages render to the same ids.

A tool-using conversation (a question, the model's tool call, the tool's result, the answer) is
driven by the stock ``openai`` client through ``/v1/chat/completions`` and ``/v1/responses`` and
by the stock ``anthropic`` client through ``/v1/messages``, each in a session of its own over
one engine. Every API translates to the same chat request, so each session must record the
same prompt ids call by call, continue its second call token-exactly from the first, and hold
exactly the ids the engine generated. A difference names the API whose translation renders
something else (a message out of order, a tool result in another role, a lost system prompt).
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
anthropic = pytest.importorskip("anthropic", reason='gateway tests need: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402

KEY = "gw-key"
SYSTEM = "You are a careful calculator."
QUESTION = "What is 3 + 4?"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
ANSWER = "The answer is 7."


def chat_agent(url: str, stream: bool) -> None:
    c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": SCHEMA}}]
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = c.chat.completions.create(model="m", messages=messages, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model="m", messages=messages, tools=tools, stream=True) if ch.choices)
    else:
        text = c.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message.content
    assert text == ANSWER


def responses_agent(url: str, stream: bool) -> None:
    c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    tools = [{"type": "function", "name": "calculator", "description": "Evaluate.", "parameters": SCHEMA}]
    items: list = [{"role": "user", "content": QUESTION}]
    first = c.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools)
    (call,) = [item for item in first.output if item.type == "function_call"]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "7"})
    if stream:
        with c.responses.stream(model="m", instructions=SYSTEM, input=items, tools=tools) as events:
            text = events.get_final_response().output_text
    else:
        text = c.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools).output_text
    assert text == ANSWER


def messages_agent(url: str, stream: bool) -> None:
    c = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=30)
    tools = [{"name": "calculator", "description": "Evaluate.", "input_schema": SCHEMA}]
    messages: list = [{"role": "user", "content": QUESTION}]
    first = c.messages.create(model="m", system=SYSTEM, max_tokens=64, messages=messages, tools=tools)
    (use,) = [block for block in first.content if block.type == "tool_use"]
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]}]
    if stream:
        with c.messages.stream(model="m", system=SYSTEM, max_tokens=64, messages=messages, tools=tools) as events:
            text = "".join(events.text_stream)
    else:
        reply = c.messages.create(model="m", system=SYSTEM, max_tokens=64, messages=messages, tools=tools)
        text = "".join(block.text for block in reply.content if block.type == "text")
    assert text == ANSWER


AGENTS = {"chat.completions": chat_agent, "responses": responses_agent, "messages": messages_agent}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_one_conversation_records_the_same_ids_through_every_api(stream):
    tokenizer = load_tiny_tokenizer()
    call_ids = tokenizer.encode(CALL, add_special_tokens=False)
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    engine = ScriptedServer(lambda request_id, prompt_ids, k: [call_ids, answer_ids][k],
                            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), append_eos=True)
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    recorded = {}
    with GatewayThread(gateway, api_key=KEY) as thread:
        for api, agent in AGENTS.items():
            agent(thread.session_url(api), stream)
            recorded[api] = gateway.close_session(api)
    generated = {api: [(c.prompt_ids, c.token_ids, c.log_probs) for c in calls] for api, calls in recorded.items()}
    assert generated["responses"] == generated["chat.completions"], "Responses renders another prompt than chat"
    assert generated["messages"] == generated["chat.completions"], "Messages renders another prompt than chat"
    for api, calls in recorded.items():
        assert [c.endpoint for c in calls] == [api, api]
        assert [c.finish_reason for c in calls] == ["tool_calls", "stop"]
        first, second = calls
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == first.prompt_ids + first.token_ids
        assert second.extra["extends_previous"] is True, api
    # The ids are the engine's, and the prompt is the template's rendering of the conversation.
    sent = [(c.prompt_ids, c.output.token_ids, c.output.log_probs) for c in engine.calls]
    assert sent == generated["chat.completions"] * 3
    text = tokenizer.decode(recorded["messages"][1].prompt_ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}")
    assert "<tool_response>\n7\n</tool_response>" in text
    assert json.loads(CALL.split("\n")[1])["name"] in text
