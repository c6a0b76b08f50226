"""Streamed answers sent as they are generated: the real ``openai`` client against the gateway
over loopback, in front of HFServer on the tiny model (and, for the tool-call and reasoning
splits, an engine that streams a scripted reply one token at a time, since random weights
write no tool calls).

What must hold: the chunks arrive one or a few tokens at a time, not as one block at the end;
the streamed text, tool calls and reasoning assemble into exactly the non-streamed answer; the
ids the session records are the non-streamed ones (the stream's text is never re-encoded); a
client that disconnects stops the decode. A failure in the joined-text checks means
:class:`~agentloop_engines.serving.gateway.stream_text.StreamText` sent text that the finished answer
does not hold (a stop string, a tool-call opening, half a character).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import StreamingScript  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402

GREEDY = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "How many apples?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def engine():
    server = HFServer(build_tiny_model(initializer_range=0.3), max_model_len=2048)
    yield server
    asyncio.run(server.close())


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def _timed(stream) -> list[tuple[float, object]]:
    return [(time.perf_counter(), chunk) for chunk in stream]


def test_engine_stream_joins_into_generate(engine):
    """HFServer's deltas, joined, are exactly ``generate``'s ids and log-probs, one or a few
    tokens per delta (the law of :mod:`agentloop_engines.streaming`)."""
    prompt = engine.tokenizer.encode("Ann has 3 apples.")

    async def both():
        whole = await engine.generate("whole", prompt, {**GREEDY, "logprobs": True})
        deltas = [d async for d in engine.generate_stream("streamed", prompt, {**GREEDY, "logprobs": True})]
        return whole, deltas

    whole, deltas = asyncio.run(both())
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids == deltas[-1].output.token_ids
    assert [lp for d in deltas for lp in d.log_probs] == pytest.approx(whole.log_probs, abs=1e-5)
    assert deltas[-1].output.stop_reason == whole.stop_reason == "length"
    assert len(deltas) >= len(whole.token_ids) // 4, [len(d.token_ids) for d in deltas]


def test_streamed_chat_arrives_token_by_token_and_matches_the_whole_answer(engine):
    """The openai client's streamed chat arrives in many chunks (the first long before the
    last) and assembles into the non-streamed answer; the session records the same ids."""
    gateway = Gateway(engine, engine.tokenizer)
    with GatewayThread(gateway) as t:
        c = _client(t.session_url("whole"))
        whole = c.chat.completions.create(model="tiny", messages=QUESTION, extra_body={"ignore_eos": True},
                                          max_tokens=32, temperature=0.0)
        s = _client(t.session_url("streamed"))
        start = time.perf_counter()
        chunks = _timed(s.chat.completions.create(model="tiny", messages=QUESTION, extra_body={"ignore_eos": True},
                                                  max_tokens=32, temperature=0.0, stream=True,
                                                  stream_options={"include_usage": True}))
    recorded = gateway.close_session("streamed")[0]
    assert recorded.token_ids == gateway.close_session("whole")[0].token_ids == whole.choices[0].token_ids
    content = [(at, ch.choices[0].delta.content) for at, ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(text for _, text in content) == whole.choices[0].message.content
    n_tokens = len(recorded.token_ids)
    assert n_tokens == 32
    # Structural, not a clock threshold: a whole-then-split answer would arrive in ~1 content chunk.
    assert len(content) >= n_tokens // 4, f"{len(content)} content chunks for {n_tokens} tokens"
    assert start < content[0][0] < chunks[-1][0]
    last = [ch for _, ch in chunks if ch.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert last.choices[0].model_extra["token_ids"] == recorded.token_ids
    assert chunks[-1][1].usage.completion_tokens == n_tokens
    assert len({ch.id for _, ch in chunks}) == 1


def test_streamed_completion_holds_back_a_stop_string(engine):
    """A stop string found in the middle of the answer: the stream never sends it (nor a
    prefix that could become it) and ends where the non-streamed answer ends."""
    prompt = "Ann has 3 apples."
    free = asyncio.run(engine.generate("free", engine.tokenizer.encode(prompt), GREEDY))
    text = engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    assert stop in text
    gateway = Gateway(engine, engine.tokenizer)
    with GatewayThread(gateway) as t:
        c = _client(t.base_url)
        whole = c.completions.create(model="tiny", prompt=prompt, stop=[stop], extra_body={"ignore_eos": True},
                                     max_tokens=32, temperature=0.0)
        chunks = list(c.completions.create(model="tiny", prompt=prompt, stop=[stop], extra_body={"ignore_eos": True},
                                           max_tokens=32, temperature=0.0, stream=True))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    assert "".join(pieces) == whole.choices[0].text == text[: text.index(stop)]
    assert len(pieces) > 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["token_ids"] == whole.choices[0].token_ids


def test_client_disconnect_stops_the_decode(engine):
    """Closing the connection after the first chunks aborts the engine request: far fewer
    tokens are decoded than the 1,500 asked for."""
    gateway = Gateway(engine, engine.tokenizer)
    asked = 1500
    with GatewayThread(gateway) as t:
        before = engine.stats["generated_tokens"]
        body = {"model": "tiny", "messages": QUESTION, "max_tokens": asked, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{t.base_url}/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(6)]
        at_disconnect = engine.stats["generated_tokens"] - before
        deadline = time.monotonic() + 60
        while engine._by_id and time.monotonic() < deadline:  # the aborted row leaves within a decode step
            time.sleep(0.02)
        after = engine.stats["generated_tokens"] - before
    assert any(line.startswith("data: ") for line in seen)
    assert not engine._by_id, "the request was still running a minute after its client went away"
    assert after < asked // 2, f"{after} of {asked} tokens decoded ({at_disconnect} when the client left)"


def _assemble(chunks) -> dict:
    content, reasoning, calls = [], [], {}
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    return {"content": "".join(content), "reasoning": "".join(reasoning), "calls": [calls[i] for i in sorted(calls)],
            "pieces": [p for p in content if p]}


def test_streamed_tool_call_parses_into_the_non_streamed_calls(engine):
    """Content before the call streams (never a piece of ``<tool_call>``); the call arrives as
    one delta when its block closes, with the id, name and arguments of the non-streamed call."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": "3 + 4"}})
    script = StreamingScript(engine.tokenizer, f"Let me work this out.\n<tool_call>\n{call}\n</tool_call>")
    gateway = Gateway(script, engine.tokenizer, tool_parser="hermes")
    with GatewayThread(gateway) as t:
        c = _client(t.base_url)
        whole = c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS)
        chunks = list(c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, stream=True))
    got = _assemble(chunks)
    message = whole.choices[0].message
    assert got["content"] == message.content == "Let me work this out."
    assert len(got["pieces"]) > 1
    assert not any("<" in p for p in got["pieces"])
    assert got["calls"] == [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                            for c in message.tool_calls]
    assert json.loads(got["calls"][0]["arguments"]) == {"expression": "3 + 4"}
    assert [ch for ch in chunks if ch.choices][-1].choices[0].finish_reason == "tool_calls"


def test_streamed_reasoning_is_sent_as_reasoning_content(engine):
    """With a reasoning parser, the thinking streams as ``reasoning_content`` and the answer as
    ``content``, each equal to the non-streamed message's; no delimiter leaks into either."""
    script = StreamingScript(engine.tokenizer, "<think>\nThree and four make seven.\n</think>\n\nThe answer is 7.")
    gateway = Gateway(script, engine.tokenizer, reasoning_parser="qwen3")
    with GatewayThread(gateway) as t:
        c = _client(t.base_url)
        whole = c.chat.completions.create(model="tiny", messages=QUESTION)
        chunks = list(c.chat.completions.create(model="tiny", messages=QUESTION, stream=True))
    got = _assemble(chunks)
    assert got["reasoning"] == whole.choices[0].message.model_extra["reasoning_content"] == "Three and four make seven."
    assert got["content"] == whole.choices[0].message.content == "The answer is 7."
    assert len(got["pieces"]) > 1
    assert "think>" not in got["content"] + got["reasoning"]


def test_a_wrapper_that_forwards_attributes_streams_through_its_own_generate(engine):
    """A ``TransparentServerWrapper`` forwards ``generate_stream`` to its engine by attribute;
    the stream must still go through the wrapper's ``generate`` (what it adds would be lost)."""
    from agentloop_core.server_wrapper import TransparentServerWrapper
    from agentloop_engines.streaming import stream_tokens

    class Counting(TransparentServerWrapper):
        calls = 0

        async def generate(self, request_id, prompt_ids, sampling_params=None):
            Counting.calls += 1
            return await self.server.generate(request_id, prompt_ids, sampling_params)

    async def run():
        return [d async for d in stream_tokens(Counting(engine), "w", [5, 6, 7], {"max_tokens": 4})]

    deltas = asyncio.run(run())
    assert Counting.calls == 1
    assert len(deltas) == 1
    assert deltas[0].output is not None
    assert deltas[0].token_ids == deltas[0].output.token_ids
