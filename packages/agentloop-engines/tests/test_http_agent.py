"""``http_agent``: an agent written with the real ``openai`` client runs against its session URL of
a gateway over the loop's engine, and its recorded calls become training segments whose mask-1
tokens are exactly what the engine generated; a context-editing agent yields two segments."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from agentloop_core.runtime import AgentLoopWorker  # noqa: E402
from agentloop_core.testing import load_tiny_tokenizer  # noqa: E402
from agentloop_engines.serving.http_agent import HTTPAgentLoop, close_gateways  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import calculator_call, generated_runs, scripted  # noqa: E402

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
SAMPLING = {"temperature": 1.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


def calculator_agent(base_url: str, row: dict, *, summarise_after: int | None = None) -> dict:
    """A plain OpenAI-client tool agent; with ``summarise_after`` it replaces the conversation
    so far with a summary once that many tool results came back (a context-editing agent)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = list(row["raw_prompt"])
    results = 0
    for _ in range(6):
        reply = client.chat.completions.create(model="any", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        if not message.tool_calls:
            return {"reward": 1.0 if "42" in (message.content or "") else 0.0, "metrics": {"tool_results": results}}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            value = eval(json.loads(call.function.arguments)["expression"], {"__builtins__": {}})  # test input only
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
            results += 1
        if summarise_after is not None and results == summarise_after:
            messages = [messages[0], {"role": "user", "content": f"So far: the tool gave {value}. Finish."}]
    return {"reward": 0.0}


def summarising_agent(base_url: str, row: dict) -> dict:
    return calculator_agent(base_url, row, summarise_after=2)


async def _async_agent(base_url: str, row: dict) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    reply = await client.chat.completions.create(model="any", messages=row["raw_prompt"])
    return float(len(reply.choices[0].message.content or ""))


ROW = {"index": 7, "raw_prompt": [{"role": "user", "content": "What is 6*7, then that minus 0?"}]}


async def test_a_tool_using_openai_agent_trains_on_the_engine_tokens(tok):
    server = scripted(tok, [calculator_call("6*7"), calculator_call("42-0"), "The answer is 42."])
    loop = HTTPAgentLoop(server, tok, {"agent": calculator_agent})
    outputs = await loop.run(SAMPLING, **ROW)
    assert len(outputs) == 1, "each call extends the previous one: one segment"
    (out,) = outputs
    engine_ids = [call.output.token_ids for call in server.calls]
    assert generated_runs(out) == engine_ids
    lps = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m]
    assert lps == [lp for call in server.calls for lp in call.output.log_probs]
    assert out.reward_score == 1.0
    assert out.metrics["http_calls"] == 3
    assert out.metrics["tool_results"] == 2
    # The tool results the agent sent are in the context, rendered by the template.
    text = tok.decode(out.prompt_ids + out.response_ids)
    assert "<tool_response>\n42\n</tool_response>" in text
    # The trainer's sampling parameters reached the engine, whatever the agent asked for.
    assert all(call.sampling_params.temperature == 1.0 and call.sampling_params.logprobs for call in server.calls)
    assert all(call.request_id.startswith("7-") for call in server.calls)  # one session, sticky


async def test_a_context_editing_agent_yields_two_segments(tok):
    server = scripted(tok, [calculator_call("6*7"), calculator_call("42-0"), "The answer is 42."])
    loop = HTTPAgentLoop(server, tok, {"agent": f"{__name__}:summarising_agent"})
    outputs = await loop.run(SAMPLING, **ROW)
    assert len(outputs) == 2
    first, second = outputs
    engine_ids = [call.output.token_ids for call in server.calls]
    assert generated_runs(first) == engine_ids[:2]
    assert generated_runs(second) == engine_ids[2:]
    assert "So far: the tool gave 42." in tok.decode(second.prompt_ids)
    assert first.reward_score == second.reward_score == 1.0


async def test_segments_reach_the_batch_as_one_trajectory(tok):
    server = scripted(tok, [calculator_call("6*7"), calculator_call("42-0"), "The answer is 42."])
    worker = AgentLoopWorker(server, tok, {"agent_loop_configs": {"http_agent": {"agent": summarising_agent}},
                                           "sampling_params": SAMPLING})
    rows = [{**ROW, "index": i, "agent_name": "http_agent"} for i in range(2)]
    outputs = await worker.generate_sequences(rows)
    assert [(o.trajectory_index, o.segment_index) for o in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {o.reward_score for o in outputs} == {1.0}


async def test_an_async_agent_and_bad_agents(tok):
    server = scripted(tok, ["Hello there."])
    (out,) = await HTTPAgentLoop(server, tok, {"agent": _async_agent}).run(SAMPLING, **ROW)
    assert out.reward_score == float(len("Hello there."))
    with pytest.raises(ValueError, match="made no model call through its base_url"):
        await HTTPAgentLoop(server, tok, {"agent": lambda base_url, row: None}).run(SAMPLING, **ROW)
    with pytest.raises(ValueError, match="returned str"):
        await HTTPAgentLoop(scripted(tok, ["x"]), tok, {"agent": _returns_text}).run(SAMPLING, **ROW)
    with pytest.raises(ValueError, match="needs config 'agent'"):
        HTTPAgentLoop(server, tok, {})
    with pytest.raises(ValueError, match="is not callable"):
        HTTPAgentLoop(server, tok, {"agent": 3})


def _returns_text(base_url: str, row: dict) -> str:
    openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(model="m", messages=row["raw_prompt"])
    return "done"


def _endless_agent(base_url: str, row: dict) -> float:
    """Keeps asking until the gateway refuses: an agent with no notion of the trainer's budget."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["raw_prompt"])
    while True:
        reply = client.chat.completions.create(model="any", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]


async def test_the_response_budget_ends_an_endless_agent(tok):
    server = scripted(tok, ["one two three four five six seven eight nine ten"] * 50)
    (out,) = await HTTPAgentLoop(server, tok, {"agent": _endless_agent, "response_length": 60}).run(SAMPLING, **ROW)
    assert len(out.response_ids) <= 60
    assert out.metrics["response_budget_spent"] == 1
    # Every call was capped to what was left, so the last generation ends exactly at the budget
    # or the next user turn did not fit; every mask-1 token is still the engine's.
    assert generated_runs(out) == [call.output.token_ids for call in server.calls]
    assert server.calls[-1].sampling_params.max_tokens < 64
