"""Token-exact sessions: a chat call that only appends messages continues the previous call's ids.

A black-box agent sends its history back as text. The engine's ids are often not what that text
re-encodes to (sampling writes a word in pieces; an engine cut by ``max_tokens`` never wrote the
end-of-turn token), so rendering the history again would break the trajectory into segments
although the agent edited nothing. These tests make the engine write such ids and check that
the recorded calls form one segment whose mask-1 tokens are exactly the engine's ids, that a real
edit of the history still starts a new segment, and that the session continues exactly after it.

The engine is a ScriptedServer; rendering (the tiny tokenizer's ChatML template, or the real
gpt-oss / Mistral / Qwen3 templates from ../shared when present), tool-call parsing, HTTP and the
``openai`` client are real.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentloop_core.segments import SegmentBuilder
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_engines.serving.gateway import Gateway, RecordedCall
from agentloop_engines.serving.gateway.continuation import (
    ChatState,
    extension,
    normalize_message,
    renderer_key,
)
from agentloop_engines.testing.gateway_fixtures import hermes_call

SHARED_TEMPLATES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates"
KEY = "gw-key"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def spelled(tokenizer, text: str) -> list[int]:
    """``text`` written one character at a time: ids a sampling engine can produce, which are not
    the canonical tokenization of their text."""
    return [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]


class Script:
    """Replies in order, one per engine call (across requests)."""

    def __init__(self, *replies: list[int]) -> None:
        self.replies = list(replies)

    def __call__(self, request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return self.replies.pop(0)


def assert_one_exact_segment(calls: list[RecordedCall], engine: ScriptedServer) -> None:
    """Each call's prompt extends the previous prompt + generated ids, and the one segment's
    mask-1 tokens are the engine's ids, in order, with its log-probs."""
    for prev, call in zip(calls, calls[1:], strict=False):
        context = prev.prompt_ids + prev.token_ids
        assert call.prompt_ids[: len(context)] == context
    assert [c.extra["extends_previous"] for c in calls] == [False] + [True] * (len(calls) - 1)
    builder = SegmentBuilder.from_calls(calls)
    assert builder.num_segments == 1
    (out,) = builder.outputs()
    generated = [t for s in engine.calls for t in s.output.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    logprobs = [lp for s in engine.calls for lp in s.output.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    assert out.prompt_ids == calls[0].prompt_ids


# ---- comparing messages ----------------------------------------------------------------------


def test_normalized_messages_ignore_what_sdks_add_but_not_what_the_model_wrote():
    returned = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}]}
    sent_back = {"role": "assistant", "content": "", "refusal": None, "audio": None, "annotations": [],
                 "function_call": None, "tool_calls": [
                     {"id": "call_1", "function": {"name": "f", "arguments": {"b": [2], "a": 1}}}]}
    assert normalize_message(returned) == normalize_message(sent_back)
    for changed in ({"content": "x"}, {"tool_calls": [{"id": "call_2", "function": {"name": "f", "arguments": {}}}]},
                    {"tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": {"a": 2, "b": [2]}}}]}):
        assert normalize_message(returned) != normalize_message({**sent_back, **changed})
    assert normalize_message({"role": "user", "content": "hi"}) != normalize_message({"role": "user", "content": "ho"})
    assert normalize_message({"role": "tool", "content": "1", "tool_call_id": "a"}) != normalize_message(
        {"role": "tool", "content": "1", "tool_call_id": "b"})


def test_only_appended_non_assistant_messages_extend(tokenizer):
    from agentloop_core.tokenization import ChatRenderer, Trajectory

    key = renderer_key(None, {})
    history = [{"role": "user", "content": "a"}]
    reply = {"role": "assistant", "content": "b"}
    state = ChatState(key, Trajectory(ChatRenderer(tokenizer), history),
                      (*map(normalize_message, history), normalize_message(reply)))
    follow = {"role": "user", "content": "c"}
    assert extension(state, key, [*history, reply, follow]) == [follow]
    assert extension(state, key, [*history, reply]) is None  # nothing new
    assert extension(state, key, [*history, reply, {"role": "assistant", "content": "x"}, follow]) is None
    assert extension(state, key, [{"role": "user", "content": "A"}, reply, follow]) is None  # edited
    assert extension(state, key, [*history, {"role": "assistant", "content": "B"}, follow]) is None
    assert extension(state, renderer_key(TOOLS, {}), [*history, reply, follow]) is None  # tools changed
    assert extension(state, renderer_key(None, {"enable_thinking": False}), [*history, reply, follow]) is None


# ---- over HTTP with the openai client ------------------------------------------------------


def http_thread(gateway: Gateway):
    pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
    pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
    from agentloop_engines.serving.gateway import GatewayThread

    return GatewayThread(gateway, api_key=KEY)


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)


def test_non_canonical_ids_stay_one_exact_segment(tokenizer, eos):
    first, second = spelled(tokenizer, "apples"), spelled(tokenizer, "pears, then plums")
    assert first != tokenizer.encode("apples", add_special_tokens=False)  # really not canonical
    engine = ScriptedServer(Script(first + [eos], second + [eos]))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with http_thread(gateway) as thread:
        c = client(thread.session_url("fruit"))
        messages: list = [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "Name a fruit."}]
        r1 = c.chat.completions.create(model="m", messages=messages)
        assert r1.choices[0].message.content == "apples"
        messages += [r1.choices[0].message, {"role": "user", "content": "Two more?"}]
        c.chat.completions.create(model="m", messages=messages)
        calls = gateway.close_session("fruit")
    assert calls[0].prompt_ids == gateway.render(messages[:2])  # the first call is rendered whole
    # What rendering the history again would have given: not an extension of call 1.
    context = calls[0].prompt_ids + calls[0].token_ids
    rerendered = gateway.render([*messages[:2], {"role": "assistant", "content": "apples"}, messages[3]])
    assert rerendered[: len(context)] != context
    assert_one_exact_segment(calls, engine)
    assert gateway.continued_calls == 1
    assert gateway.restarted_calls == 0


def test_a_streamed_reply_sent_back_continues_exactly(tokenizer, eos):
    engine = ScriptedServer(Script(spelled(tokenizer, "apples") + [eos], spelled(tokenizer, "pears") + [eos]))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with http_thread(gateway) as thread:
        c = client(thread.session_url("stream"))
        messages: list = [{"role": "user", "content": "Name a fruit."}]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       c.chat.completions.create(model="m", messages=messages, stream=True) if chunk.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another?"}]
        c.chat.completions.create(model="m", messages=messages)
        calls = gateway.close_session("stream")
    assert_one_exact_segment(calls, engine)


def test_a_turn_cut_by_max_tokens_gets_the_template_close_as_mask_0(tokenizer, eos):
    # The engine never writes <|im_end|>: stopped by max_tokens, then a follow-up.
    long = spelled(tokenizer, "a long answer that goes on")
    engine = ScriptedServer(Script(long, spelled(tokenizer, "ok") + [eos]), eos_token_id=eos)
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with http_thread(gateway) as thread:
        c = client(thread.session_url("cut"))
        messages: list = [{"role": "user", "content": "Talk."}]
        r1 = c.chat.completions.create(model="m", messages=messages, max_tokens=5)
        assert r1.choices[0].finish_reason == "length"
        messages += [r1.choices[0].message, {"role": "user", "content": "Shorter."}]
        c.chat.completions.create(model="m", messages=messages, max_tokens=5)
        calls = gateway.close_session("cut")
    assert calls[0].stop_reason == "length"
    assert calls[0].token_ids == long[:5]
    assert_one_exact_segment(calls, engine)
    delta = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].token_ids):]
    assert tokenizer.decode(delta) == "<|im_end|>\n<|im_start|>user\nShorter.<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_round_trip_is_one_exact_segment(tokenizer, eos):
    call_ids = spelled(tokenizer, hermes_call("calculator", expression="3 + 4"))
    engine = ScriptedServer(Script(call_ids + [eos], spelled(tokenizer, "It is 7.") + [eos],
                                   spelled(tokenizer, "It is 9.") + [eos]))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with http_thread(gateway) as thread:
        c = client(thread.session_url("tools"))
        messages: list = [{"role": "user", "content": "What is 3 + 4?"}]
        r1 = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r1.choices[0].finish_reason == "tool_calls"
        call = r1.choices[0].message.tool_calls[0]
        messages += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r2 = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r2.choices[0].message.content == "It is 7."
        # An agent that keeps messages as dicts, arguments re-serialized with other spacing.
        messages[1] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps(json.loads(call.function.arguments),
                                                                        indent=2)}}]}
        messages += [{"role": "assistant", "content": r2.choices[0].message.content},
                     {"role": "user", "content": "And 4 + 5?"}]
        c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        calls = gateway.close_session("tools")
    assert [c.finish_reason for c in calls] == ["tool_calls", "stop", "stop"]
    assert_one_exact_segment(calls, engine)


def test_an_edited_history_starts_a_new_segment_and_the_session_continues_exactly(tokenizer, eos):
    replies = [spelled(tokenizer, w) + [eos] for w in ("apples", "pears", "plums", "figs")]
    engine = ScriptedServer(Script(*replies))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    with http_thread(gateway) as thread:
        c = client(thread.session_url("edit"))
        messages: list = [{"role": "user", "content": "Name a fruit."}]
        r = c.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message, {"role": "user", "content": "Another."}]
        r = c.chat.completions.create(model="m", messages=messages)
        # The agent summarises its context: the first turns are replaced.
        messages = [{"role": "system", "content": "Fruits so far: apples, pears."},
                    {"role": "user", "content": "Another."}]
        r = c.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message, {"role": "user", "content": "Last one."}]
        c.chat.completions.create(model="m", messages=messages)
        calls = gateway.close_session("edit")
    assert [c.extra["extends_previous"] for c in calls] == [False, True, False, True]
    assert calls[2].prompt_ids == gateway.render(messages[:2])
    builder = SegmentBuilder.from_calls(calls)
    assert builder.num_segments == 2
    first, second = builder.outputs()
    masked = [[t for t, m in zip(o.response_ids, o.response_mask, strict=True) if m] for o in (first, second)]
    assert masked == [replies[0] + replies[1], replies[2] + replies[3]]
    assert gateway.continued_calls == 2
    assert gateway.restarted_calls == 1


# ---- without HTTP ------------------------------------------------------------------------


async def test_changed_tools_or_an_edited_reply_render_the_whole_request(tokenizer, eos):
    engine = ScriptedServer(Script(*[spelled(tokenizer, "ok") + [eos]] * 4))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    messages = [{"role": "user", "content": "Hi."}]
    r = await gateway.chat_completion({"messages": messages, "tools": TOOLS}, session_id="s")
    messages += [r.body["choices"][0]["message"], {"role": "user", "content": "Again."}]
    await gateway.chat_completion({"messages": messages}, session_id="s")  # tools dropped
    r = await gateway.chat_completion({"messages": messages}, session_id="s")  # same messages: no reply appended
    messages += [{**r.body["choices"][0]["message"], "content": "OK!"}, {"role": "user", "content": "More."}]
    await gateway.chat_completion({"messages": messages}, session_id="s")  # the reply was edited
    calls = gateway.close_session("s")
    assert [c.extra["extends_previous"] for c in calls] == [False] * 4
    assert calls[3].prompt_ids == gateway.render(messages)


async def test_calls_outside_sessions_and_completions_are_rendered_as_before(tokenizer, eos):
    engine = ScriptedServer(Script(spelled(tokenizer, "apples") + [eos], spelled(tokenizer, "pears") + [eos],
                                   spelled(tokenizer, "figs") + [eos]))
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    messages = [{"role": "user", "content": "Fruit?"}]
    r = await gateway.chat_completion({"messages": messages})
    messages += [r.body["choices"][0]["message"], {"role": "user", "content": "More."}]
    r = await gateway.chat_completion({"messages": messages})
    assert r.call is None
    assert engine.calls[1].prompt_ids == gateway.render(messages)
    r = await gateway.completion({"prompt": "Fruit:"}, session_id="s")
    assert "extends_previous" not in r.call.extra
    assert r.call.prompt_ids == tokenizer.encode("Fruit:")


async def test_concurrent_calls_extending_the_same_call(tokenizer, eos):
    engine = ScriptedServer(lambda rid, p, i: spelled(tokenizer, f"reply {i}") + [eos], latency_s=0.01)
    gateway = Gateway(engine, tokenizer, tool_parser="hermes")
    messages = [{"role": "user", "content": "Start."}]
    r = await gateway.chat_completion({"messages": messages}, session_id="s")
    base = [*messages, r.body["choices"][0]["message"]]
    a, b = await asyncio.gather(
        gateway.chat_completion({"messages": [*base, {"role": "user", "content": "A"}]}, session_id="s"),
        gateway.chat_completion({"messages": [*base, {"role": "user", "content": "B"}]}, session_id="s"))
    assert a.call.extra["extends_previous"]
    assert b.call.extra["extends_previous"]
    # The call that finished first is the one the session continues from.
    first, text = (a, "A") if a.call.index < b.call.index else (b, "B")
    r = await gateway.chat_completion({"messages": [*base, {"role": "user", "content": text},
                                                    first.body["choices"][0]["message"],
                                                    {"role": "user", "content": "C"}]}, session_id="s")
    assert r.call.extra["extends_previous"]
    context = first.call.prompt_ids + first.call.token_ids
    assert r.call.prompt_ids[: len(context)] == context


# ---- real templates ----------------------------------------------------------------------

CALC = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]
FAMILIES = {
    "gpt_oss": ("openai-gpt-oss-120b.jinja", "<|return|>", [
        '<|channel|>analysis<|message|>Multiply them.<|end|><|start|>assistant to=functions.calc'
        '<|channel|>commentary json<|message|>{"x": "6*7"}<|call|>',
        "<|channel|>final<|message|>42<|return|>", "<|channel|>final<|message|>4<|return|>"]),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>", [
        '[TOOL_CALLS][{"name": "calc", "arguments": {"x": "6*7"}, "id": "a1b2c3d4e"}]</s>',
        "6 times 7 is 42.</s>", "4.</s>"]),
    "hermes": ("Qwen-Qwen3-0.6B.jinja", "<|im_end|>", [
        '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call><|im_end|>',
        "<think>\nok\n</think>\n\n42<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]),
}


@pytest.mark.parametrize("parser", sorted(FAMILIES))
async def test_real_templates_tool_round_trip_and_follow_up(parser):
    template, stop, turns = FAMILIES[parser]
    if not (SHARED_TEMPLATES / template).exists():
        pytest.skip(f"needs ../shared/data/chat_templates/{template} (absent in a fresh clone)")
    tok = tiny_tokenizer_for_template(SHARED_TEMPLATES / template)
    # The tool call and the answers written one character at a time (not canonical), special tokens whole.
    specials = sorted(tok.all_special_tokens, key=len, reverse=True)

    def pieces(text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in specials if text.startswith(s, i)), None)
            piece = special or text[i]
            ids += tok.encode(piece, add_special_tokens=False)
            i += len(piece)
        return ids

    replies = [pieces(t) for t in turns]
    # The template adds its special tokens past the tiny vocabulary: the engine must know them.
    engine = ScriptedServer(Script(*replies), vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(stop))
    gateway = Gateway(engine, tok, tool_parser=parser)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 times 7?"}]
    r = await gateway.chat_completion({"messages": messages, "tools": CALC}, session_id="s")
    message = r.body["choices"][0]["message"]
    assert r.body["choices"][0]["finish_reason"] == "tool_calls"
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
    r = await gateway.chat_completion({"messages": messages, "tools": CALC}, session_id="s")
    messages += [r.body["choices"][0]["message"], {"role": "user", "content": "Thanks. And 2+2?"}]
    await gateway.chat_completion({"messages": messages, "tools": CALC}, session_id="s")
    calls = gateway.close_session("s")
    assert calls[0].prompt_ids == gateway.render(messages[:2], CALC)
    assert_one_exact_segment(calls, engine)
