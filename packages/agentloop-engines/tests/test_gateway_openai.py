"""The gateway driven by the real ``openai`` client over HTTP (uvicorn on 127.0.0.1 in a thread).

The engine is a ScriptedServer replying with encoded text, so each test decides what the
"model" says; rendering (the tiny tokenizer's ChatML template), tool-call parsing (hermes),
HTTP, SSE and the client are all real. A failure in an exact-id assertion means the gateway
re-encoded, cut or reordered something the engine generated: compare the recorded call with
``server.calls``.
"""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.serving.gateway import SESSION_HEADER, SESSION_KEY_HEADER, Gateway, GatewayThread  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import hermes_call  # noqa: E402

KEY = "gw-key"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture
def gateway(engine, tokenizer):
    return Gateway(engine, tokenizer, tool_parser="hermes", model_name="tiny")


@pytest.fixture
def thread(gateway):
    with GatewayThread(gateway, api_key=KEY) as t:
        yield t


def client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30, **kwargs)


def test_chat_returns_the_text_and_the_exact_tokens(thread, engine, tokenizer, replies):
    replies.by_prompt["hi"] = ["Hello there."]
    r = client(thread.base_url).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    choice = r.choices[0]
    assert choice.message.content == "Hello there."
    assert choice.finish_reason == "stop"
    assert r.model == "gpt-4o"
    assert r.usage.completion_tokens == len(engine.calls[0].output.token_ids)
    assert r.prompt_token_ids == engine.calls[0].prompt_ids
    assert choice.token_ids == engine.calls[0].output.token_ids
    assert choice.token_logprobs == engine.calls[0].output.log_probs


def test_prompt_is_the_chat_template_rendering(thread, engine, tokenizer):
    client(thread.base_url).chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    text = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert engine.calls[0].prompt_ids == tokenizer.encode(text, add_special_tokens=False)


def test_tool_calls_round_trip_to_a_final_answer(thread, engine, gateway, replies):
    replies.by_prompt["What is 3 + 4?"] = [hermes_call("calculator", expression="3 + 4")]
    replies.by_prompt["<tool_response>\n7\n</tool_response>"] = ["The answer is 7."]
    c = client(thread.session_url("traj-1"))
    messages: list = list(QUESTION)
    first = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "3 + 4"}
    assert call.id
    assert first.choices[0].message.content is None
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    final = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == "The answer is 7."
    assert final.choices[0].finish_reason == "stop"

    calls = gateway.close_session("traj-1")
    assert [c.finish_reason for c in calls] == ["tool_calls", "stop"]
    for rec, sent in zip(calls, engine.calls, strict=True):
        assert rec.prompt_ids == sent.prompt_ids
        assert rec.token_ids == sent.output.token_ids
        assert rec.log_probs == sent.output.log_probs
        assert sent.request_id == "traj-1"
    # The history the client sent back (arguments as a JSON string) renders the call the engine
    # generated, so the second prompt extends the first prompt + generation.
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].token_ids)] == \
        calls[0].prompt_ids + calls[0].token_ids
    assert calls[1].request["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"expression": "3 + 4"}'


def test_streaming_content_and_usage(thread, replies, engine):
    replies.by_prompt["hi"] = ["Hello there."]
    stream = client(thread.base_url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello there."
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(engine.calls[0].output.token_ids)
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].token_ids == engine.calls[0].output.token_ids


def test_streaming_tool_calls(thread, replies, gateway):
    replies.by_prompt["What is 3 + 4?"] = ["Let me compute. " + hermes_call("calculator", expression="3 + 4")]
    stream = client(thread.session_url("s-stream")).chat.completions.create(
        model="m", messages=QUESTION, tools=TOOLS, stream=True)
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in stream:
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == "Let me compute."
    assert calls[0]["name"] == "calculator"
    assert json.loads(calls[0]["arguments"]) == {"expression": "3 + 4"}
    assert calls[0]["id"]
    # Streamed calls are recorded like any other.
    assert gateway.recorder.get("s-stream")[0].finish_reason == "tool_calls"


def test_text_stop_cuts_after_the_completing_token(thread, replies, engine, gateway, tokenizer):
    replies.by_prompt["count"] = ["one two three STOP four five"]
    r = client(thread.session_url("s-stop")).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "count"}], stop=["STOP", "never"])
    assert r.choices[0].message.content == "one two three "
    assert r.choices[0].finish_reason == "stop"
    sampled = engine.calls[0].output.token_ids
    rec = gateway.recorder.get("s-stop")[0]
    k = len(rec.token_ids)
    assert rec.token_ids == sampled[:k]
    assert rec.log_probs == engine.calls[0].output.log_probs[:k]
    assert "STOP" in tokenizer.decode(sampled[:k])
    assert "STOP" not in tokenizer.decode(sampled[: k - 1])
    assert rec.dropped_after_stop == len(sampled) - k > 0
    assert rec.stop_reason == "stop"
    assert r.choices[0].token_ids == rec.token_ids


def test_the_choice_names_the_stop_string_that_matched(thread, replies):
    """As vLLM does, the choice's ``stop_reason`` is the stop string that ended the answer (the
    Messages API's ``stop_sequence`` reads it), streamed or not, and None when EOS ended it."""
    replies.by_prompt["count"] = ["one two three STOP four five"] * 2 + ["one two"]
    c = client(thread.base_url)
    asked = {"model": "m", "messages": [{"role": "user", "content": "count"}], "stop": ["never", "STOP"]}
    whole = c.chat.completions.create(**asked)
    assert whole.choices[0].model_extra["stop_reason"] == "STOP"
    last = [ch for ch in c.chat.completions.create(**asked, stream=True) if ch.choices][-1]
    assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == ("stop", "STOP")
    assert c.chat.completions.create(**asked).choices[0].model_extra["stop_reason"] is None


def test_a_single_token_stop_string_is_sent_to_the_engine(thread, replies, engine, tokenizer):
    replies.by_prompt["hi"] = ["a b"]
    client(thread.base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    stop="<tool_call>")
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in engine.calls[0].sampling_params.stop_token_ids


def test_completions_with_token_ids_and_text(thread, engine, tokenizer, gateway):
    c = client(thread.session_url("s-cmpl"))
    r = c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4)
    assert r.prompt_token_ids == [5, 6, 7] == engine.calls[0].prompt_ids
    assert r.choices[0].token_ids == engine.calls[0].output.token_ids
    assert r.choices[0].text == tokenizer.decode(engine.calls[0].output.token_ids, skip_special_tokens=True)
    r = c.completions.create(model="m", prompt="The answer is", max_tokens=4, logprobs=0)
    assert engine.calls[1].prompt_ids == tokenizer.encode("The answer is")
    assert r.choices[0].logprobs.token_logprobs == engine.calls[1].output.log_probs
    chunks = list(c.completions.create(model="m", prompt=[[8, 9]], max_tokens=4, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(
        engine.calls[2].output.token_ids, skip_special_tokens=True)
    assert [rec.prompt_ids for rec in gateway.recorder.get("s-cmpl")] == [[5, 6, 7], engine.calls[1].prompt_ids, [8, 9]]
    with pytest.raises(openai.BadRequestError, match="batches of prompts"):
        c.completions.create(model="m", prompt=["a", "b"])


def test_models(thread):
    assert [m.id for m in client(thread.base_url).models.list()] == ["tiny"]
    assert [m.id for m in client(thread.session_url("x")).models.list()] == ["tiny"]


def test_harmless_keys_are_accepted_and_harmful_ones_are_400(thread, replies):
    replies.by_prompt["hi"] = ["ok"] * 2
    c = client(thread.base_url)
    r = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], user="u", metadata={"k": "v"}, store=False,
        service_tier="auto", presence_penalty=0, frequency_penalty=0, logprobs=True, top_logprobs=2,
        tools=TOOLS, parallel_tool_calls=False, tool_choice="auto", seed=1, temperature=0.5, top_p=0.9,
        extra_body={"top_k": 5})
    assert r.choices[0].message.content == "ok"
    assert [t.logprob for t in r.choices[0].logprobs.content] == r.choices[0].token_logprobs
    for kwargs, name in [({"n": 2}, "n=2"), ({"logit_bias": {"5": 3}}, "logit_bias"),
                         ({"presence_penalty": 1.0}, "presence_penalty"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"extra_body": {"guided_json": {}}}, "guided_json"),
                         ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)
        assert name in info.value.body["message"], info.value.body
        assert info.value.body["code"] == "invalid_request"


def test_auth_body_limit_and_error_shape(gateway):
    with GatewayThread(gateway, api_key=KEY, max_request_bytes=2048) as t:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=t.base_url, api_key="wrong", max_retries=0).models.list()
        with httpx.Client(base_url=t.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            assert http.get("/health", headers={"Authorization": ""}).json()["model"] == "tiny"
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 4000}]})
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "request_too_large"
            r = http.post("/v1/chat/completions", json={"messages": []})
            assert r.status_code == 400
            assert "messages" in r.json()["error"]["message"]
            assert http.delete("/sessions/missing").status_code == 401  # a control route
            assert http.delete("/sessions/missing", headers={"Authorization": f"Bearer {t.control_key}"}).status_code \
                == 404


def test_sessions_record_every_call_in_order_over_http(thread, engine, replies, tokenizer):
    replies.by_prompt["hi"] = ["one", "two"]
    c = client(thread.session_url("run-7"))
    for _ in range(2):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    c.completions.create(model="m", prompt=[3, 4], max_tokens=2)
    with httpx.Client(base_url=thread.url, headers={"Authorization": f"Bearer {thread.control_key}"}) as http:
        assert "run-7" in http.get("/sessions").json()["sessions"]
        body = http.get("/sessions/run-7").json()
        assert body["num_calls"] == 3
        assert [c["endpoint"] for c in body["calls"]] == ["chat.completions", "chat.completions", "completions"]
        assert [c["token_ids"] for c in body["calls"]] == [call.output.token_ids for call in engine.calls]
        assert [c["prompt_ids"] for c in body["calls"]] == [call.prompt_ids for call in engine.calls]
        assert body["calls"][0]["request"]["messages"] == [{"role": "user", "content": "hi"}]
        assert body["calls"][1]["response"]["choices"][0]["message"]["content"] == "two"
        assert http.delete("/sessions/run-7").json()["num_calls"] == 3
        r = http.get("/sessions/run-7")
        assert r.status_code == 404
        assert "already taken" in r.json()["error"]["message"]
    assert {call.request_id for call in engine.calls} == {"run-7"}


def test_the_session_header_names_the_session_on_plain_paths(thread, gateway, engine):
    key = gateway.open_session("hdr-1")
    with pytest.raises(openai.NotFoundError, match="without its key"):
        client(thread.base_url, default_headers={SESSION_HEADER: "hdr-1"}).completions.create(
            model="m", prompt=[3], max_tokens=2)
    c = client(thread.base_url, default_headers={SESSION_HEADER: "hdr-1", SESSION_KEY_HEADER: key})
    c.completions.create(model="m", prompt=[3], max_tokens=2)
    assert [r.token_ids for r in gateway.recorder.pop("hdr-1")] == [engine.calls[0].output.token_ids]
    with pytest.raises(openai.BadRequestError, match="use one of them"):
        client(thread.session_url("other"), default_headers={SESSION_HEADER: "hdr-1"}).completions.create(
            model="m", prompt=[3], max_tokens=2)


def test_opening_a_session_over_http_sets_its_sampling(thread, engine):
    with httpx.Client(base_url=thread.url, headers={"Authorization": f"Bearer {thread.control_key}"}) as http:
        r = http.post("/sessions/opened", json={"sampling_params": {"temperature": 0.25, "max_tokens": 3}})
        assert r.json()["base_url"] == f"/sessions/opened/{r.json()['session_key']}/v1"
        assert http.get("/sessions/opened").json() == {"session_id": "opened", "num_calls": 0, "calls": []}
    client(thread.session_url("opened")).completions.create(model="m", prompt=[3], temperature=1.0, max_tokens=50)
    sp = engine.calls[0].sampling_params
    assert (sp.temperature, sp.max_tokens) == (0.25, 3)


def test_sessions_stick_to_one_replica_behind_llm_server_client(tokenizer, replies):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replicas = [ScriptedServer(replies, eos_token_id=eos, append_eos=True) for _ in range(2)]
    replies.by_prompt["hi"] = ["reply"] * 6
    gateway = Gateway(LLMServerClient(replicas), tokenizer)
    with GatewayThread(gateway) as t:
        for _ in range(3):  # interleaved: A, B, A, B, A, B
            for session in ("A", "B"):
                client(t.session_url(session)).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
        recorded = {s: gateway.close_session(s) for s in ("A", "B")}
    served = {s: {c.extra["replica"] for c in calls} for s, calls in recorded.items()}
    assert served["A"] != served["B"], served
    assert all(len(v) == 1 for v in served.values()), served
    for replica in replicas:
        assert len({call.request_id for call in replica.calls}) == 1
        assert len(replica.calls) == 3
    for session, calls in recorded.items():
        (index,) = served[session]
        assert [c.token_ids for c in calls] == [call.output.token_ids for call in replicas[index].calls]
    assert gateway.server.policy.session_replica("A") is None  # close_session freed the sticky slot


async def test_a_server_on_the_callers_loop(tokenizer, replies):
    """``server_loop``: the engine lives on the rollout's loop; the gateway thread submits to it."""
    loop = asyncio.get_running_loop()
    seen = []

    class LoopBound(ScriptedServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            seen.append(asyncio.get_running_loop())
            return await super().generate(request_id, prompt_ids, sampling_params)

    engine = LoopBound(replies, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), append_eos=True)
    replies.by_prompt["hi"] = ["there"]
    gateway = Gateway(engine, tokenizer, server_loop=loop)
    with GatewayThread(gateway) as t:
        async with openai.AsyncOpenAI(base_url=t.session_url("x"), api_key="none", max_retries=0) as c:
            r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "there"
    assert seen == [loop]
    assert gateway.close_session("x")[0].token_ids == engine.calls[0].output.token_ids


def test_one_port_serves_generate_and_the_gateway(engine, gateway, replies):
    """``create_app(server, gateway=...)`` (what ``agentloop serve`` runs): ``/generate`` for
    remote ``LLMServerClient`` replicas and the gateway's OpenAI endpoints and sessions."""
    from agentloop_engines.serving.server import ServerThread

    replies.by_prompt["hi"] = ["hello"]
    with ServerThread(engine, api_key=KEY, gateway=gateway) as t:
        c = client(f"{t.url}/sessions/both/{gateway.open_session('both')}/v1")
        assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices[0] \
            .message.content == "hello"
        with httpx.Client(base_url=t.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            out = http.post("/generate", json={"request_id": "g", "prompt_ids": [1, 2],
                                               "sampling_params": {"max_tokens": 2}}).json()
            assert out["stop_reason"] in ("stop", "length")
            assert http.get("/sessions/both", headers={"Authorization": f"Bearer {t.control_key}"}).json()[
                "num_calls"] == 1


def test_no_replica_left_is_503(tokenizer):
    class Dead(ScriptedServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            raise ConnectionError("replica is gone")

    with (
        GatewayThread(Gateway(LLMServerClient([Dead()]), tokenizer)) as t,
        pytest.raises(openai.InternalServerError) as info,
    ):
        client(t.base_url).completions.create(model="m", prompt=[1], max_tokens=2)
    assert info.value.status_code == 503
    assert "replica is gone" in info.value.body["message"]


PLAIN_CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
"""ChatML that never reads ``tools`` (SmolLM2's template, without its default system prompt)."""


def test_tools_with_a_template_that_ignores_them_are_refused_until_a_tool_aware_one_is_set(engine, replies):
    from agentloop_core.testing import CountingProcessor
    from agentloop_core.tokenization import resolve_chat_template

    plain = load_tiny_tokenizer()
    plain.chat_template = PLAIN_CHATML
    processor = CountingProcessor(plain)
    with GatewayThread(Gateway(engine, processor, tool_parser="hermes"), api_key=KEY) as t:
        c = client(t.base_url)
        for _ in range(2):
            with pytest.raises(openai.BadRequestError, match="ignores tools=") as info:
                c.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
            assert info.value.status_code == 400
            message = info.value.body["message"]
            assert "agentloop serve CHECKPOINT --chat-template chatml-hermes" in message
            assert "Gateway(..., chat_template=" in message
        assert processor.rendered == 2  # decided once for the template: one render with tools, one without
        assert engine.calls == []  # never generated without the tools
        # Without tools the same template serves.
        replies.by_prompt["hi"] = ["Hello."]
        assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices[0] \
            .message.content == "Hello."

    replies.by_prompt["What is 3 + 4?"] = [hermes_call("calculator", expression="3 + 4")]
    gateway = Gateway(engine, plain, tool_parser="hermes", chat_template=resolve_chat_template("chatml-hermes"))
    with GatewayThread(gateway, api_key=KEY) as t:
        r = client(t.base_url).chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"expression": "3 + 4"}
    assert '"name": "calculator"' in plain.decode(engine.calls[-1].prompt_ids)  # the model saw the tool
