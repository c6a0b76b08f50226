"""(e) The OpenAI-compatible gateway in front of HFServer serving the real checkpoint, driven by
the real ``openai`` client over loopback HTTP: a calculator question comes back as parsed
``tool_calls``, the tool result goes back as a tool message, and the session records exactly the
ids the engine generated, as one segment.

The raw checkpoint answers such a question in prose, greedy, even with the schemas rendered and
two worked tool-call examples in the history (tried: "12 + 7 = 9", a ``<tool_response>`` of its
own), so the engine serves the checkpoint after the short tool-call fit
(``tool_fitted_model``); what is tested is the gateway: that it parses what the real tokenizer
produced into ``tool_calls`` and records the exact tokens. A failure in an exact-id assertion
means the gateway changed the prompt or sampling parameters, or re-encoded the generation.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from real_model_helpers import calculator_prompts, calculator_tools, report

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')

GREEDY = {"max_tokens": 48, "temperature": 0.0}

REAL_MODELS = ["smollm2"]
"""SmolLM2 only (conftest's parametrization): the test needs a checkpoint that writes tool calls
after the short fit, and what it tests, the gateway's parsing, does not depend on the family."""


def test_gateway_returns_the_real_models_tool_call(tool_fitted_model, tool_tokenizer):
    from agentloop_core.segments import SegmentBuilder
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.gateway import Gateway, GatewayThread
    from agentloop_tools.builtin.calculator import evaluate_expression, format_number

    engine = HFServer(tool_fitted_model, tool_tokenizer, max_model_len=2048)
    gateway = Gateway(engine, tool_tokenizer, tool_parser="hermes", model_name="smollm2-135m-instruct")
    messages: list = calculator_prompts(1, seed=33)[0]
    tools = calculator_tools()
    with GatewayThread(gateway) as thread:
        client = openai.OpenAI(base_url=thread.session_url("real-1"), api_key="none", max_retries=0, timeout=120)
        first = client.chat.completions.create(model="smollm2", messages=messages, tools=tools, **GREEDY)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", f"no tool call parsed from {choice.message.content!r}"
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.type == "function"
        assert call.function.name == "calculator"
        assert call.id
        assert set(arguments) == {"expression"}
        assert isinstance(arguments["expression"], str)
        result = format_number(evaluate_expression(arguments["expression"]))
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": result}]
        final = client.chat.completions.create(model="smollm2", messages=messages, tools=tools, **GREEDY)
    calls = gateway.close_session("real-1")
    report(f"gateway: tool call {arguments} -> {result}; final {final.choices[0].message.content!r}")

    # The prompt is the tool-aware template's rendering; the ids are what greedy generate gives.
    prompt = tool_tokenizer.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, tokenize=False)
    assert first.prompt_token_ids == tool_tokenizer.encode(prompt, add_special_tokens=False) == calls[0].prompt_ids
    direct = asyncio.run(engine.generate("direct", calls[0].prompt_ids, {**GREEDY, "logprobs": True}))
    assert choice.token_ids == calls[0].token_ids == direct.token_ids
    assert calls[0].log_probs == pytest.approx(direct.log_probs, abs=1e-5)
    # The parsed call is the JSON the model wrote between the tags.
    text = tool_tokenizer.decode(calls[0].token_ids)
    body = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    assert json.loads(body) == {"name": "calculator", "arguments": arguments}
    # The client sent its history back as text; the gateway continued the session's exact ids.
    context = calls[0].prompt_ids + calls[0].token_ids
    assert calls[1].prompt_ids[: len(context)] == context
    assert f"<tool_response>\n{result}\n</tool_response>" in tool_tokenizer.decode(calls[1].prompt_ids[len(context):])
    (out,) = SegmentBuilder.from_calls(calls).outputs()
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == \
        calls[0].token_ids + calls[1].token_ids
    asyncio.run(engine.close())
