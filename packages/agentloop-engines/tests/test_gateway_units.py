"""Gateway pieces without HTTP: session bounds, text stop cuts, request key policy."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.protocol import ServerCapabilities, TokenOutput
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_engines.serving.gateway import (
    Gateway,
    RecordedCall,
    SessionCallLimitError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRecorder,
    find_stop,
)
from agentloop_engines.serving.gateway.messages_request import to_chat_body
from agentloop_engines.serving.gateway.openai_request import parse_chat_request, parse_completion_request
from agentloop_engines.serving.gateway.prompt_limits import PromptLimits
from agentloop_engines.serving.gateway.responses_request import parse_responses_request

USER = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def call(ids: list[int]) -> RecordedCall:
    return RecordedCall(index=0, endpoint="completions", prompt_ids=[1], token_ids=ids, log_probs=None,
                        stop_reason="stop", finish_reason="stop", request={}, response={})


# ---- sessions ----------------------------------------------------------------------------

def test_calls_are_numbered_in_order_and_pop_forgets_the_session():
    rec = SessionRecorder()
    rec.open("t1")
    assert rec.get("t1") == []
    for ids in ([1], [2], [3]):
        rec.begin("t1")
        rec.record("t1", call(ids))
    calls = rec.pop("t1")
    assert [c.index for c in calls] == [0, 1, 2]
    assert [c.token_ids for c in calls] == [[1], [2], [3]]
    with pytest.raises(SessionNotFoundError, match="already taken"):
        rec.pop("t1")


def test_idle_sessions_expire_and_the_error_says_so():
    clock = Clock()
    rec = SessionRecorder(ttl_s=10, clock=clock)
    rec.open("old")
    clock.now = 5
    rec.open("young")
    clock.now = 12  # "old" idle 12 s > ttl, "young" 7 s
    assert rec.session_ids() == ["young"]
    assert rec.expired == 1
    with pytest.raises(SessionNotFoundError, match=r"expired after ttl_s=10"):
        rec.get("old")
    rec.begin("young")  # a call refreshes the session
    clock.now = 21
    assert "young" in rec


def test_the_least_recently_used_session_is_evicted_at_max_sessions():
    rec = SessionRecorder(max_sessions=2)
    rec.open("a")
    rec.open("b")
    rec.begin("a")  # "b" is now the least recently used
    rec.open("c")
    assert sorted(rec.session_ids()) == ["a", "c"]
    assert rec.evicted == 1
    with pytest.raises(SessionNotFoundError, match=r"evicted .* max_sessions=2"):
        rec.pop("b")
    with pytest.raises(SessionNotFoundError, match="never opened"):
        rec.pop("nobody")


def test_a_session_refuses_calls_beyond_its_limit_before_generating():
    rec = SessionRecorder(max_calls_per_session=2)
    for ids in ([1], [2]):
        rec.begin("s")
        rec.record("s", call(ids))
    with pytest.raises(SessionCallLimitError, match="max_calls_per_session=2"):
        rec.begin("s")


def test_a_session_has_a_key_and_its_settings_are_fixed_at_open():
    rec = SessionRecorder()
    key = rec.open("s", sampling_overrides={"temperature": 0.5}, response_length=8)
    assert rec.key("s") == key
    assert len(key) >= 32
    with pytest.raises(SessionExistsError, match="already open"):
        rec.open("s", sampling_overrides={"temperature": 2.0})
    assert rec.begin("s", key=key) == {"temperature": 0.5}
    assert rec.remaining_budget("s", [1]) == 8
    # A wrong key and a session that is not open read the same, and neither opens anything.
    with pytest.raises(SessionNotFoundError) as wrong:
        rec.begin("s", key="x" * len(key))
    with pytest.raises(SessionNotFoundError) as missing:
        rec.begin("other", key=key)
    assert str(wrong.value).replace("'s'", "'other'") == str(missing.value)
    assert "other" not in rec
    with pytest.raises(SessionNotFoundError):
        rec.authorize("s", "")
    rec.authorize("s", key)
    assert rec.key("new", create=True) != key  # in-process: opened with a key of its own
    rec.pop("s")
    with pytest.raises(SessionNotFoundError):
        rec.begin("s", key=key)  # taken: its URL stops working
    assert "s" not in rec


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 201, "sp ace", "q?x"])
def test_session_ids_must_be_url_and_request_id_safe(bad):
    with pytest.raises(ValueError, match="invalid session id"):
        SessionRecorder().open(bad)


# ---- text stop -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def test_stop_cuts_right_after_the_completing_token(tokenizer):
    ids = tokenizer.encode("The answer is 7. END and more words", add_special_tokens=False)
    decode = lambda t: tokenizer.decode(list(t))  # noqa: E731
    match = find_stop(ids, decode, ["END"])
    assert match is not None
    assert match.text == "The answer is 7. "
    assert "END" in decode(ids[: match.keep])
    assert "END" not in decode(ids[: match.keep - 1])
    assert find_stop(ids, decode, ["nowhere"]) is None


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab \n.#", min_size=1, max_size=40), stop=st.sampled_from(["b", "a.", "\n", "##", " a"]))
def test_the_kept_prefix_is_the_shortest_that_holds_a_stop(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = lambda t: tokenizer.decode(list(t))  # noqa: E731
    match = find_stop(ids, decode, [stop])
    if stop not in decode(ids):
        assert match is None
        return
    assert match is not None
    assert stop in decode(ids[: match.keep])
    assert stop not in decode(ids[: match.keep - 1])
    assert match.text == decode(ids[: match.keep]).split(stop)[0]


# ---- request keys --------------------------------------------------------------------------

def test_harmless_keys_are_accepted():
    req = parse_chat_request({
        "messages": USER, "model": "gpt-4o", "user": "u1", "metadata": {"k": "v"}, "store": False,
        "parallel_tool_calls": True, "service_tier": "auto", "presence_penalty": 0, "frequency_penalty": 0.0,
        "logprobs": True, "top_logprobs": 3, "n": 1, "logit_bias": {}, "response_format": {"type": "text"},
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 5, "seed": 3,
    })
    assert req.sampling == {"max_tokens": 5, "seed": 3}
    assert req.stream
    assert req.include_usage
    assert req.logprobs


@pytest.mark.parametrize(("key", "value", "message"), [
    ("n", 2, "send n separate requests"),
    ("logit_bias", {"5": 10}, "logit_bias"),
    ("presence_penalty", 0.5, "presence_penalty"),
    ("frequency_penalty", -1, "frequency_penalty"),
    ("response_format", {"type": "json_object"}, "constrained decoding"),
    ("tool_choice", "required", "cannot be enforced"),
    ("functions", [{"name": "f"}], "unsupported request key(s) ['functions']"),
    ("stop", [""], "empty string"),
    ("chat_template_kwargs", {"tools": []}, "may not set 'tools'"),
    ("chat_template", "{{ messages }}", "configure the template on the server"),
])
def test_harmful_keys_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_chat_request({"messages": USER, key: value})


TRANSLATED = {
    "responses": (parse_responses_request, {"model": "m", "input": "hi"},
                  [{"type": "function", "name": "f", "parameters": {}}], {"type": "web_search"}),
    "messages": (lambda body: to_chat_body(body, PromptLimits()),
                 {"model": "m", "max_tokens": 8, "messages": USER},
                 [{"name": "f", "input_schema": {}}], {"type": "web_search_20250305", "name": "web_search"}),
}


@pytest.mark.parametrize("api", list(TRANSLATED))
def test_translated_apis_check_keys_and_tools_in_the_same_words(api):
    """The Responses and Messages translations refuse an unknown key, a ``tools`` that is no
    list and a tool they do not serve as chat does (one shared check): naming the key, the
    list, and the tool by its index."""
    parse, body, tools, refused_tool = TRANSLATED[api]
    assert parse({**body, "tools": tools}).chat["tools"][0]["function"]["name"] == "f"
    with pytest.raises(ValueError, match=re.escape("unsupported request key(s) ['functions']")):
        parse({**body, "functions": []})
    with pytest.raises(ValueError, match=re.escape("'tools' must be a list of tool objects, got {")):
        parse({**body, "tools": {"name": "f"}})
    with pytest.raises(ValueError, match=re.escape("tools[1] ")):
        parse({**body, "tools": [*tools, refused_tool]})


def test_tool_call_arguments_are_decoded_for_templates_and_nulls_dropped():
    req = parse_chat_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "name": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
    system, assistant, _ = req.messages
    assert system == {"role": "system", "content": "be brief"}
    assert "name" not in assistant
    assert assistant["content"] == ""
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"x": 1}, "not json"]


@pytest.mark.parametrize(("prompt", "expected"), [("hello", "hello"), ([1, 2], [1, 2]), (["hi"], "hi"), ([[3]], [3])])
def test_completion_prompts(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], "", [True]])
def test_completion_batches_and_empty_prompts_are_refused(prompt):
    with pytest.raises(ValueError, match="prompt"):
        parse_completion_request({"prompt": prompt})


async def test_session_overrides_replace_the_agents_sampling(tokenizer):
    server = ScriptedServer([[5, 6]], eos_token_id=None)
    gateway = Gateway(server, tokenizer, sampling_overrides={"temperature": 1.0}, default_max_tokens=7)
    gateway.open_session("s", sampling_overrides={"top_p": 0.5})
    out = await gateway.chat_completion({"messages": USER, "temperature": 0, "top_p": 0.9}, session_id="s")
    sp = server.calls[0].sampling_params
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.logprobs) == (1.0, 0.5, 7, True)
    assert server.calls[0].request_id == "s"
    assert out.call is not None
    assert out.call.token_ids == [5, 6]


async def test_tools_without_a_parser_are_refused(tokenizer):
    gateway = Gateway(ScriptedServer([[5]]), tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ValueError, match="tool_parser='hermes'"):
        await gateway.chat_completion({"messages": USER, "tools": tools})


async def test_no_log_probs_from_an_engine_without_them(tokenizer):
    class NoLogprobs(ScriptedServer):
        capabilities = ServerCapabilities(logprobs=False)

        async def generate(self, request_id, prompt_ids, sampling_params):
            assert sampling_params["logprobs"] is False
            return TokenOutput(token_ids=[7], log_probs=None, stop_reason="length")

    out = await Gateway(NoLogprobs(), tokenizer).completion({"prompt": [1, 2]}, session_id="s")
    assert out.body["choices"][0]["token_logprobs"] is None
    assert out.body["choices"][0]["finish_reason"] == "length"
    assert out.call is not None
    assert out.call.log_probs is None


async def test_a_base_model_without_chat_template_serves_completions_only(tokenizer):
    import copy

    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    gateway = Gateway(ScriptedServer([[5, 6]]), base)
    assert (await gateway.completion({"prompt": "Ann has"})).body["choices"][0]["token_ids"] == [5, 6]
    with pytest.raises(ValueError, match="serves /v1/completions only"):
        await gateway.chat_completion({"messages": USER})


# ---- what the prompt limits count ---------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126, exclude_characters='"\\'),
                              max_size=6),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.text(alphabet="abc", max_size=3), inner, max_size=4),
                    max_leaves=12))
def test_json_size_is_the_compact_json_size_without_quotes(value):
    """``json_size`` counts what ``json.dumps`` writes (compact), less the string quotes: so
    numbers, booleans, nulls and brackets count like text."""
    import json

    from agentloop_engines.serving.gateway.prompt_limits import json_size

    text = json.dumps(value, separators=(",", ":"))
    strings = len(re.findall(r'"(?:[^"\\]|\\.)*"', text))
    assert json_size(value) == len(text) - 2 * strings


def test_prompt_limits_bound_each_list_and_the_nesting_depth():
    from agentloop_engines.serving.gateway import PromptLimits
    from agentloop_engines.serving.gateway.prompt_limits import PromptLimitError

    limits = PromptLimits(max_tools=2, max_tool_calls=2, max_stop_strings=2, max_json_depth=8)
    tool = {"type": "function", "function": {"name": "f"}}
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}] * 3
    for body, name in [({"messages": USER, "tools": [tool] * 3}, "max_tools"),
                       ({"messages": [*USER, {"role": "assistant", "tool_calls": calls}]}, "max_tool_calls"),
                       ({"messages": USER, "stop": ["a", "b", "c"]}, "max_stop_strings"),
                       ({"messages": [{"role": "user", "content": "hi", "x": [[[[[[1]]]]]]}]}, "max_json_depth")]:
        with pytest.raises(PromptLimitError, match=name):
            parse_chat_request(body, limits)
    deep = '{"a": [[[[[[1]]]]]]}'  # decoded from the string OpenAI sends: its depth counts too
    with pytest.raises(PromptLimitError, match="max_json_depth"):
        parse_chat_request({"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": deep}}]}]}, limits)
    with pytest.raises(PromptLimitError, match="max_stop_strings"):
        parse_completion_request({"prompt": "hi", "stop": ["a", "b", "c"]}, limits)
    parse_chat_request({"messages": USER, "tools": [tool] * 2, "stop": ["a", "b"]}, limits)


def test_stream_text_never_splits_a_character_nor_sends_a_stop_prefix():
    """Fed one token at a time, StreamText sends no half character (U+FFFD) and nothing of a
    stop string, and its pieces join into the text before the stop."""
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_engines.serving.gateway.stream_text import StreamText, held_suffix

    tok = load_tiny_tokenizer()
    text = "Prix: 12€, naïve 日本語 🙂 done. STOP here"
    ids = tok.encode(text, add_special_tokens=False)

    def decode(i):
        return tok.decode(list(i), skip_special_tokens=True)

    assert any("\ufffd" in decode(ids[:n]) for n in range(1, len(ids))), "the text no longer splits a character"
    stream = StreamText(decode, ["STOP"])
    pieces = [d["content"] for n in range(len(ids)) for d in stream.feed(ids[n:n + 1])]
    assert "".join(pieces) == text[: text.index("STOP")]
    assert not any("\ufffd" in p or "S" in p for p in pieces)
    assert len(pieces) > 5
    assert held_suffix("abc ST", ["STOP"]) == 2
    assert held_suffix("abc", ["STOP"]) == 0
    assert held_suffix("<tool_c", ["<tool_call>", "</think>"]) == 7
